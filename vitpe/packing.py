"""Native resolution and aspect ratio (NaViT, Dehghani et al., NeurIPS 2023): images of different sizes and aspect
ratios packed into rows of at most ``max_tokens`` patch tokens.

A packed batch is pixels per patch plus a :class:`~vitpe.coords.TokenGrid` saying which image and which grid cell
each token is. The model embeds the patches, gives each image its own prefix (class/register) tokens, lets tokens
attend only within their own image, and pools per image: a packed image gets the logits it would get alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from einops import rearrange
from torch import Tensor

from .coords import Size2, TokenGrid, cell_coords, grid_cells, random_keep, snap, to_2tuple

__all__ = ["Packed", "PackingError", "image_patches", "pack_images", "pack_patches"]


class PackingError(ValueError):
    """Images that cannot be packed as asked; the message says what to change."""


@dataclass(frozen=True, eq=False)
class Packed:
    """A packed batch: ``patches`` ``(B, max_tokens, C*p*p)`` (each patch's pixels in ``(c, p, p)`` order, a patch
    convolution's kernel order), ``grid`` the tokens' cells, image sizes, slots and the ``(row, slot)`` of every image in
    input order (``grid.images``). Padding tokens have slot -1. Build it with :func:`pack_images`."""

    patches: Tensor
    grid: TokenGrid
    patch_size: int

    @property
    def num_images(self) -> int:
        return int(self.grid.images.shape[0])

    @property
    def num_tokens(self) -> int:
        """Patch tokens that belong to images (not padding)."""
        return int((self.grid.segments >= 0).sum())

    def to(self, device: torch.device, non_blocking: bool = False) -> "Packed":
        return Packed(self.patches.to(device, non_blocking=non_blocking), self.grid.to(device), self.patch_size)


def image_patches(image: Tensor, patch_size: int) -> Tensor:
    """``(C, H, W) -> (H/p * W/p, C*p*p)``: the patches of one image in raster order, each in ``(c, p, p)`` order."""
    return rearrange(image, "c (h p1) (w p2) -> (h w) (c p1 p2)", p1=patch_size, p2=patch_size)


def _grid_of(image: Tensor, patch_size: int, i: int) -> Tuple[int, int]:
    if image.dim() != 3:
        raise PackingError(f"image {i} has shape {tuple(image.shape)}; packing takes (C, H, W) images")
    h, w = image.shape[-2:]
    if h % patch_size or w % patch_size:
        raise PackingError(f"image {i} is {h}x{w}, not a multiple of patch_size {patch_size}; resize it, e.g. to "
                           f"{snap(h, patch_size)}x{snap(w, patch_size)}")
    return h // patch_size, w // patch_size


def pack_patches(
    items: Sequence[Tuple[Tensor, Tensor, Tuple[int, int]]],
    max_tokens: int,
    patch_size: int,
    ref_grid: Size2 = (1, 1),
    coord_mode: str = "interpolate",
) -> Packed:
    """Pack images given as ``(patches (n, C*p*p), cells (n, 2) (column, row), grid (h, w))`` (all of an image's cells,
    or any subset of them: dropped tokens) into rows of ``max_tokens`` tokens: first fit, largest image first (which
    leaves less padding than input order); ``grid.images`` keeps each image's place, so results come back in input order.

    ``ref_grid``/``coord_mode`` set the coordinates; the model recomputes them in its own (``TokenGrid.rebased``).
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise PackingError(f"max_tokens must be a positive number of patch tokens per row, got {max_tokens!r}")
    if not items:
        raise PackingError("nothing to pack: the list of images is empty")
    for i, (patches, _, (h, w)) in enumerate(items):
        if patches.shape[0] > max_tokens:
            raise PackingError(f"image {i} has {patches.shape[0]} patch tokens ({h}x{w} patches), more than the budget of "
                               f"max_tokens={max_tokens}; raise max_tokens to at least {patches.shape[0]}, or use smaller images")
    room: List[int] = []  # free tokens per row
    placed: List[Tuple[int, int, int]] = [(0, 0, 0)] * len(items)  # (row, slot, offset) per image, in input order
    slots: List[int] = []
    for i in sorted(range(len(items)), key=lambda i: -items[i][0].shape[0]):  # stable: equal sizes keep their order
        n = items[i][0].shape[0]
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            row = len(room)
            room.append(max_tokens)
            slots.append(0)
        placed[i] = (row, slots[row], max_tokens - room[row])
        room[row] -= n
        slots[row] += 1
    first = items[0][0]
    rows, dim = len(room), first.shape[1]
    patches = first.new_zeros(rows, max_tokens, dim)
    cells = torch.zeros(rows, max_tokens, 2, dtype=torch.long)
    sizes = torch.ones(rows, max_tokens, 2, dtype=torch.long)
    segments = torch.full((rows, max_tokens), -1, dtype=torch.long)
    for i, ((p, c, (h, w)), (row, slot, at)) in enumerate(zip(items, placed)):
        if p.shape[1] != dim:
            raise PackingError(f"image {i} has patches of {p.shape[1]} values, image 0 of {dim}: all images need the same channels")
        n = p.shape[0]
        patches[row, at : at + n] = p
        cells[row, at : at + n] = c
        sizes[row, at : at + n] = torch.tensor([w, h])
        segments[row, at : at + n] = slot
    ref = to_2tuple(ref_grid, "ref_grid")
    images = torch.tensor([(r, s) for r, s, _ in placed], dtype=torch.long)
    canvas = (max(h for _, _, (h, _) in items), max(w for _, _, (_, w) in items))
    grid = TokenGrid(ref, cell_coords(cells, sizes, ref, coord_mode), cells, sizes, coord_mode, None, segments, images, max(slots), canvas)
    return Packed(patches, grid, patch_size)


def pack_images(
    images: Sequence[Tensor],
    patch_size: int,
    max_tokens: int,
    *,
    token_keep: float = 1.0,
    generator: Optional[torch.Generator] = None,
    ref_grid: Size2 = (1, 1),
    coord_mode: str = "interpolate",
) -> Packed:
    """Pack images ``(C, H_i, W_i)`` of any sizes divisible by ``patch_size`` into rows of ``max_tokens`` patch tokens.

    ``token_keep < 1`` keeps a random fraction of each image's tokens first (NaViT's token dropping), at least one.
    The images keep their order in ``grid.images``; logits and losses come back per image, in that order.
    """
    items = []
    for i, img in enumerate(images):
        h, w = _grid_of(img, patch_size, i)
        cells, patches = grid_cells((h, w)), image_patches(img, patch_size)
        if token_keep != 1:
            keep = random_keep(1, h * w, token_keep, generator)[0]
            patches, cells = patches[keep], cells[keep]
        items.append((patches, cells, (h, w)))
    return pack_patches(items, max_tokens, patch_size, ref_grid, coord_mode)
