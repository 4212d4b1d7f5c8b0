"""Batch-level augmentation of uint8 image tensors: cheap enough that 2 CPU cores keep up with training.

Per-image PIL pipelines cost more than a small ViT's step on CPU; these operate on whole batches.
Randomness comes from torch's global generator, which the trainer seeds per step, so a resumed run
draws exactly the augmentations an uninterrupted one would have.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AUGMENTS", "TTA_MODES", "BatchAugment", "normalize", "tta_views", "crop_boxes", "crop_resize"]

AUGMENTS = ("none", "flip", "crop", "crop_flip", "trivial", "randaugment")


# Test-time augmentation: the views whose predictions are averaged. "shift" moves the image one pixel up, down, left
# and right (reflect padding, as the training crop pads), the small translations airbench averages over.
TTA_MODES = ("none", "flip", "shift", "flip_shift")


def tta_views(x: Tensor, mode: str) -> Sequence[Tensor]:
    """The images ``x`` ``(B, C, H, W)`` and their test-time views for ``mode`` (one of :data:`TTA_MODES`)."""
    if mode not in TTA_MODES:
        raise ValueError(f"unknown test-time augmentation {mode!r}; choose one of {', '.join(TTA_MODES)}")
    views = [x]
    if mode in ("flip", "flip_shift"):
        views.append(x.flip(-1))
    if mode in ("shift", "flip_shift"):
        h, w = x.shape[-2:]
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
        views += [padded[..., 1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1))]
    return views


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 ``(B, C, H, W)`` -> float, standardised per channel."""
    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
    return (x.float() / 255 - m) / s


def random_translate(x: Tensor, pad: int) -> Tensor:
    """Random crop of the reflect-padded image, one offset per sample (CIFAR's pad-and-crop)."""
    if pad <= 0:
        return x
    b, c, h, w = x.shape
    xp = F.pad(x.float(), (pad, pad, pad, pad), mode="reflect").to(x.dtype)
    dy = torch.randint(0, 2 * pad + 1, (b,))
    dx = torch.randint(0, 2 * pad + 1, (b,))
    rows = (dy[:, None] + torch.arange(h)).to(x.device)  # (B, H)
    cols = (dx[:, None] + torch.arange(w)).to(x.device)  # (B, W)
    n = torch.arange(b, device=x.device)[:, None, None]
    return xp.permute(0, 2, 3, 1)[n, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


def random_hflip(x: Tensor, p: float = 0.5) -> Tensor:
    mask = (torch.rand(x.shape[0]) < p).to(x.device).view(-1, 1, 1, 1)
    return torch.where(mask, x.flip(-1), x)


class BatchAugment:
    """``kind``: none | flip | crop | crop_flip | trivial | randaugment (the last two add crop_flip).

    TrivialAugment (Mueller & Hutter 2021) and RandAugment (Cubuk et al. 2020) come from torchvision;
    they draw one operation per call, so the batch is split into ``groups`` that each draw their own.
    ``flip=False`` for datasets whose labels a mirror image changes.
    """

    def __init__(self, kind: str = "none", flip: bool = True, pad_fraction: float = 0.125, groups: int = 16) -> None:
        from torchvision.transforms import v2

        if kind not in AUGMENTS:
            raise ValueError(f"unknown augment {kind!r}; choose one of {', '.join(AUGMENTS)}")
        self.kind, self.flip, self.pad_fraction, self.groups = kind, flip, pad_fraction, groups
        self.policy = {"trivial": v2.TrivialAugmentWide(), "randaugment": v2.RandAugment(num_ops=2, magnitude=9)}.get(kind)

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "none":
            return x
        if self.kind != "flip":  # the mirror alone: the lightest augmentation, for short schedules that underfit
            x = random_translate(x, round(self.pad_fraction * min(x.shape[-2:])))
        if self.flip and self.kind != "crop":
            x = random_hflip(x)
        if self.policy is not None:
            x = torch.cat([self.policy(chunk) for chunk in x.chunk(self.groups)])
        return x


def crop_boxes(n: int, scale: Sequence[float], ratio: Sequence[float] = (3 / 4, 4 / 3), square: bool = False) -> Tensor:
    """Content scale augmentation's draw (RandomResizedCrop, as DeiT and RoPE-ViT train): for each of ``n`` images a
    box ``(x0, y0, w, h)`` in fractions of the image, covering a fraction of its area drawn uniformly from ``scale``
    and with an aspect ratio ``w / h`` drawn log-uniformly from ``ratio`` (``square``: 1, for data rendered at any
    scale), placed uniformly. A box that would leave the image is shrunk to fit, keeping its place in the draw. The
    zoom is ``1 / w``: the content appears that much larger than in the whole image. torch's global generator draws, so
    a resumed run draws what an uninterrupted one would."""
    area = torch.empty(n).uniform_(float(scale[0]), float(scale[1]))
    log_r = torch.empty(n).uniform_(math.log(ratio[0]), math.log(ratio[1])) if not square else torch.zeros(n)
    w, h = (area * log_r.exp()).sqrt().clamp(max=1.0), (area / log_r.exp()).sqrt().clamp(max=1.0)
    x0, y0 = torch.rand(n) * (1 - w), torch.rand(n) * (1 - h)
    return torch.stack([x0, y0, w, h], -1)


def crop_resize(x: Tensor, boxes: Tensor, size: Sequence[int]) -> Tensor:
    """uint8 ``(B, C, H, W)`` images, each cropped to its box (:func:`crop_boxes`) and resampled to ``size = (h, w)`` in
    one bilinear step (a crop is at most the whole image, so this enlarges: no aliasing to guard against)."""
    b = x.shape[0]
    x0, y0, w, h = boxes.to(torch.float32).unbind(-1)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w, 2 * x0 + w - 1  # output [-1, 1] -> the box, in the input's [-1, 1]
    theta[:, 1, 1], theta[:, 1, 2] = h, 2 * y0 + h - 1
    grid = F.affine_grid(theta.to(x.device), [b, x.shape[1], int(size[0]), int(size[1])], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)
