"""Patch-embedding resizing (FlexiViT, Beyer et al., CVPR 2023): meet a new resolution by changing the
patch size and keeping the token grid, instead of keeping the patch size and changing the grid."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .coords import Size2, to_2tuple

__all__ = ["resize_matrix", "resize_patch_embed"]


def resize_matrix(old: Size2, new: Size2) -> Tensor:
    """``B`` with ``vec(resize(x)) = B vec(x)`` for a patch ``x``: ``(new_h*new_w, old_h*old_w)``.

    The resize is bilinear with antialiasing, the one vitpe uses to resize images.
    """
    (oh, ow), (nh, nw) = to_2tuple(old, "old"), to_2tuple(new, "new")
    basis = torch.eye(oh * ow, dtype=torch.float64).reshape(oh * ow, 1, oh, ow)
    resized = F.interpolate(basis, size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
    return resized.reshape(oh * ow, nh * nw).t()


def resize_patch_embed(weight: Tensor, new_size: Size2) -> Tensor:
    """PI-resize a patch-embedding kernel ``(D, C, p, p) -> (D, C, p', p')``.

    Solves ``<resize(x), w'> = <x, w>`` for every patch ``x`` in the least-squares sense:
    ``w' = pinv(B^T) w``. Upsampling patches makes it exact, so a model fed images resized by the same
    factor produces the same tokens as at its training resolution.
    """
    out_c, in_c, ph, pw = weight.shape
    nh, nw = to_2tuple(new_size, "new_size")
    if (nh, nw) == (ph, pw):
        return weight
    pinv = torch.linalg.pinv(resize_matrix((ph, pw), (nh, nw)).t())  # (nh*nw, ph*pw)
    new = weight.reshape(-1, ph * pw).to(torch.float64) @ pinv.to(weight.device).t()  # linear: gradients flow
    return new.reshape(out_c, in_c, nh, nw).to(weight.dtype)
