"""Batches of mixed sizes and aspect ratios, packed for the model (NaViT, Dehghani et al., NeurIPS 2023)."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..coords import snap
from ..packing import Packed, pack_images
from .augment import normalize
from .datasets import ImageDataset

__all__ = ["draw_sizes", "native_sizes", "mixed_batch"]


def native_sizes(aspects: Tensor, side: int, patch: int) -> List[Tuple[int, int]]:
    """``(h, w)`` per image: the area of a ``side x side`` image at the image's own aspect ratio ``w / h``, in whole
    patches (NaViT's resize that keeps the aspect ratio under a token budget)."""
    return [(snap(side / math.sqrt(a), patch), snap(side * math.sqrt(a), patch)) for a in aspects.tolist()]


def draw_sizes(n: int, sides: Sequence[int], patch: int, aspects: Optional[Tensor] = None) -> List[Tuple[int, int]]:
    """A size per image for mixed-size training, from torch's global generator: a side drawn from ``sides``; with
    ``aspects`` (images that have their own) at that aspect ratio, else the height and width drawn independently,
    so square and elongated images of every scale appear."""
    pick = torch.randint(len(sides), (n, 2)).tolist()
    if aspects is not None:
        return [native_sizes(aspects[i : i + 1], sides[a], patch)[0] for i, (a, _) in enumerate(pick)]
    return [(sides[a], sides[b]) for a, b in pick]


def mixed_batch(
    ds: ImageDataset,
    train: bool,
    index: Tensor,
    sizes: Sequence[Tuple[int, int]],
    patch_size: int,
    max_tokens: int,
    augment: Optional[Callable[[Tensor], Tensor]] = None,
    token_keep: float = 1.0,
    boxes: Optional[Tensor] = None,
) -> Packed:
    """Samples ``index`` of a split, sample ``i`` at ``sizes[i]``, augmented (per size group), normalised and packed
    into rows of ``max_tokens`` patch tokens, in the order given. ``boxes`` ``(n, 4)``: content scale augmentation, each
    sample's box filling its image (:meth:`ImageDataset.images_at`)."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for i, hw in enumerate(sizes):
        groups.setdefault(tuple(hw), []).append(i)
    images: List[Optional[Tensor]] = [None] * len(sizes)
    for hw, where in groups.items():
        x = ds.images_at(train, index[where], hw, None if boxes is None else boxes[where])
        x = normalize(augment(x) if augment is not None else x, ds.mean, ds.std)
        for j, i in enumerate(where):
            images[i] = x[j]
    return pack_images(images, patch_size, max_tokens, token_keep=token_keep)
