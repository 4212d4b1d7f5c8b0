"""The maths of every positional encoding, as pure functions of coordinates.

No state, no modules: each function is testable alone and reusable in any model. ``coords`` is ``(..., N, 2)``
with columns ``(x, y)`` (see ``vitpe.grid_coords``): one grid ``(N, 2)`` shared by a batch, or one per image
``(B, N, 2)``; every function broadcasts over the leading dimensions, so shapes are written for one grid.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "sincos_1d",
    "sincos_2d",
    "fourier_features",
    "apply_rope",
    "rotate_complex",
    "rotate_pairs",
    "axial_rope_freqs",
    "mixed_rope_freqs",
    "rope_angles",
    "relative_position_index",
    "relative_offsets",
    "lattice_offsets",
    "log_spaced",
    "sample_bias_table",
]


def sincos_1d(pos: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Transformer sinusoidal encoding (Vaswani et al. 2017): ``(..., N) -> (..., N, dim)``.

    ``PE[p, 2i] = sin(p / base^(2i/dim))``, ``PE[p, 2i+1] = cos(p / base^(2i/dim))``. Because each pair
    is a point on a circle turning at rate ``w_i``, ``PE(p + k)`` is ``PE(p)`` rotated by ``w_i k``.
    """
    if dim % 2:
        raise ValueError(f"sincos_1d needs an even dim, got {dim}")
    omega = base ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64) / dim)  # (dim/2,)
    phase = pos.to(torch.float64)[..., None] * omega  # (..., N, dim/2)
    out = torch.stack([phase.sin(), phase.cos()], dim=-1).flatten(-2)  # interleave: sin, cos, sin, cos
    return out.to(pos.dtype if pos.is_floating_point() else torch.float32)


def sincos_2d(coords: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """2D sin-cos encoding: ``(N, 2) -> (N, dim) = cat([sincos_1d(x, dim/2), sincos_1d(y, dim/2)])``.

    Half the channels encode x, half y, as in MAE (He et al. 2022) and "Better plain ViT baselines"
    (Beyer et al. 2022), with the Transformer's interleaved sin/cos order inside each half.
    """
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4 (half for x, half for y, sin/cos pairs), got {dim}")
    return torch.cat([sincos_1d(coords[..., 0], dim // 2, base), sincos_1d(coords[..., 1], dim // 2, base)], dim=-1)


def fourier_features(coords: Tensor, freqs: Tensor) -> Tensor:
    """Fourier features (Tancik et al. 2020): ``(N, 2), (F, 2) -> (N, 2F) = [cos(2 pi c B^T), sin(2 pi c B^T)]``.

    ``freqs`` are in cycles per coordinate unit (per reference patch).
    """
    phase = 2 * math.pi * coords @ freqs.t()  # (N, F)
    return torch.cat([phase.cos(), phase.sin()], dim=-1)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair ``(x[..., 2i], x[..., 2i+1])`` by the angle whose cos/sin are given.

    ``cos``/``sin`` broadcast against ``x[..., ::2]``. No rotation matrix is materialised.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (..., D/2) each
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def rotate_complex(x: Tensor, rot: Tensor) -> Tensor:
    """:func:`rotate_pairs` as one complex product: pair ``(x[..., 2i], x[..., 2i+1])`` is the complex number
    ``x_2i + i x_2i+1`` and ``rot = cos + i sin`` (complex, broadcasting against ``x[..., ::2]``). Same result,
    about half the time of the real form on CPU (forward and backward). Needs float32/float64 ``x`` whose last
    dimension is contiguous, as q and k sliced from the fused qkv projection are."""
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)


def apply_rope(x: Tensor, angles: Tensor) -> Tensor:
    """Rotary position embedding (Su et al. 2021): rotate pair ``i`` of ``x`` by ``angles[..., i]``.

    Uses ``R(phi) = [[cos, -sin], [sin, cos]]`` on ``(x[..., 2i], x[..., 2i+1])``; ``angles`` broadcasts
    against ``x[..., ::2]``. Rotations preserve norms, and ``<R(a) q, R(b) k> = <q, R(b - a) k>``, so the
    rotated dot product depends only on the offset of the positions.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"apply_rope needs an even last dimension, got {x.shape[-1]}")
    angles = angles.to(x.dtype)
    return rotate_pairs(x, angles.cos(), angles.sin())


def axial_rope_freqs(head_dim: int, theta: float = 100.0) -> Tensor:
    """RoPE-Axial frequencies (Heo et al., ECCV 2024): ``(2, head_dim/2)`` rows ``(f_x, f_y)``.

    The first ``head_dim/4`` pairs turn with x only, the rest with y only, each axis with the 1D RoPE
    spectrum ``theta^(-4i/head_dim)``.
    """
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4 (x and y halves of rotary pairs), got {head_dim}")
    mag = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim)
    zero = torch.zeros_like(mag)
    return torch.stack([torch.cat([mag, zero]), torch.cat([zero, mag])])


def mixed_rope_freqs(head_dim: int, num_heads: int, theta: float = 10.0, generator: torch.Generator | None = None) -> Tensor:
    """RoPE-Mixed initial frequencies (Heo et al., ECCV 2024): ``(2, num_heads, head_dim/2)``.

    Each head gets a random direction ``a``; half its pairs turn along ``a``, half along ``a + pi/2``,
    with magnitudes ``theta^(-4i/head_dim)``. The frequencies are then learned, mixing x and y.
    """
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    mag = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim)
    a = torch.rand(num_heads, 1, generator=generator) * 2 * math.pi  # (H, 1)
    fx = torch.cat([mag * torch.cos(a), mag * torch.cos(a + math.pi / 2)], dim=-1)  # (H, head_dim/2)
    fy = torch.cat([mag * torch.sin(a), mag * torch.sin(a + math.pi / 2)], dim=-1)
    return torch.stack([fx, fy])


def rope_angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """Rotation angles ``x * f_x + y * f_y``: ``(*B, N, 2), (2, *F, P) -> (*B, *F, N, P)``: the frequencies' own
    dimensions (layers, heads) sit between the coordinates' batch dimensions and the tokens."""
    fx, fy = freqs[0].unsqueeze(-2), freqs[1].unsqueeze(-2)  # (*F, 1, P)
    lead, n = coords.shape[:-2], coords.shape[-2]
    x = coords[..., 0].reshape(*lead, *([1] * (freqs.dim() - 2)), n, 1)
    y = coords[..., 1].reshape(*lead, *([1] * (freqs.dim() - 2)), n, 1)
    return x * fx + y * fy


def relative_position_index(window: Tuple[int, int] | int) -> Tensor:
    """Swin's relative position index (Liu et al. 2021): ``(h*w, h*w)`` long tensor into a
    ``(2h-1)(2w-1)`` table, ``index[q, k] = (dy + h - 1) * (2w - 1) + (dx + w - 1)`` with
    ``(dy, dx) = pos[q] - pos[k]``.
    """
    h, w = (window, window) if isinstance(window, int) else window
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()])  # (2, N) rows (y, x)
    rel = pos[:, :, None] - pos[:, None, :]  # (2, N, N): query minus key
    return (rel[0] + h - 1) * (2 * w - 1) + (rel[1] + w - 1)


def relative_offsets(coords: Tensor) -> Tensor:
    """All pairwise offsets ``coords[q] - coords[k]``: ``(..., N, 2) -> (..., N, N, 2)`` as ``(dx, dy)``."""
    return coords[..., :, None, :] - coords[..., None, :, :]


def lattice_offsets(size: Tuple[int, int], spacing: Tuple[float, float], device=None) -> Tensor:
    """The ``(2h-1, 2w-1, 2)`` distinct ``(dx, dy)`` offsets of a uniform lattice, laid out like Swin's
    table, so that ``lattice_offsets(...).flatten(0, 1)[relative_position_index(size)]`` equals
    ``relative_offsets(coords)``.
    """
    h, w = size
    dy = torch.arange(-(h - 1), h, device=device, dtype=torch.float32) * spacing[1]
    dx = torch.arange(-(w - 1), w, device=device, dtype=torch.float32) * spacing[0]
    gy, gx = torch.meshgrid(dy, dx, indexing="ij")
    return torch.stack([gx, gy], dim=-1)


def log_spaced(offsets: Tensor, ref: Tuple[int, int]) -> Tensor:
    """Swin-V2's log-spaced coordinates (Liu et al. 2022): offsets normalised by ``ref - 1`` to [-1, 1],
    scaled by 8, then ``sign(d) * log2(1 + |d|) / log2(8)``. Columns stay ``(dx, dy)``."""
    norm = torch.tensor([max(ref[1] - 1, 1), max(ref[0] - 1, 1)], device=offsets.device, dtype=offsets.dtype)
    d = offsets / norm * 8
    return torch.sign(d) * torch.log2(d.abs() + 1.0) / math.log2(8)


def sample_bias_table(table: Tensor, offsets: Tensor, ref: Tuple[int, int], mode: str = "bicubic") -> Tensor:
    """Sample a Swin bias table at continuous offsets.

    ``table`` is ``((2h-1)(2w-1), H)`` for a reference window ``(h, w)``; ``offsets`` is ``(..., 2)``
    ``(dx, dy)`` in reference patches. Integer offsets inside the window give the table entries; others
    are interpolated; offsets beyond the window take the border value. Returns ``(..., H)``.
    """
    h, w = ref
    img = table.t().reshape(1, -1, 2 * h - 1, 2 * w - 1)  # (1, H, 2h-1, 2w-1), row = dy + h - 1
    # align_corners=True puts table entry (r, c) exactly at normalised -1 + 2c/(W-1).
    gx = offsets[..., 0] / max(w - 1, 1)
    gy = offsets[..., 1] / max(h - 1, 1)
    grid = torch.stack([gx, gy], dim=-1).reshape(1, 1, -1, 2).to(img.dtype)
    out = F.grid_sample(img, grid, mode=mode, padding_mode="border", align_corners=True)  # (1, H, 1, M)
    return out[0, :, 0].t().reshape(*offsets.shape[:-1], -1)
