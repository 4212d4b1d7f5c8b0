"""The maths that positional encoding families share, as pure functions of coordinates (a family's own maths, such
as FIRE's features or RoPE-Mixed's frequencies, is in its family file, beside its module).

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
    "fourier_features",
    "apply_rope",
    "rotate_complex",
    "rotate_pairs",
    "rope_angles",
    "relative_position_index",
    "relative_offsets",
    "lattice_offsets",
    "sample_bias_table",
    "ROPE_SCALINGS",
    "rope_freq_scale",
    "yarn_temperature",
    "p_rope_keep",
    "skew",
    "generator_rotations",
    "rotate_blocks",
    "blocks_to_dense",
    "rotate_dense",
]


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


# ---- RoPE past its trained extent: the controls every rotary family takes -------------------------------------------


ROPE_SCALINGS = ("none", "pi", "ntk", "yarn")


def rope_freq_scale(freqs: Tensor, ratio: Tensor, method: str, ref_extent: Tensor,
                    yarn_alpha: float = 1.0, yarn_beta: float = 32.0) -> Tensor:
    """Per-frequency multipliers that let RoPE run beyond its trained extent, ``(2, *F, P)`` frequencies ``(f_x, f_y)``
    and per-axis length ratios ``ratio`` ``(*S, 2)`` (new extent / trained extent, clamped at 1) -> ``(*S, 2, *F, P)``.

    - ``"pi"``, position interpolation (Chen et al. 2023): every frequency divided by the ratio ``s`` (what
      interpolate-mode coordinates do).
    - ``"ntk"``, NTK-aware base scaling (bloc97 2023): the base grows so the highest frequency is kept and the lowest
      is divided by ``s``; frequency of log-rank ``r`` in [0, 1] (0: highest) is multiplied by ``s^-r``. On a geometric
      spectrum this is exactly ``theta' = theta s^(d/(d-2))``.
    - ``"yarn"`` (Peng et al., ICLR 2024), "NTK-by-parts": a band that turns fewer than ``yarn_alpha`` times over the
      trained extent is interpolated (``1/s``), one that turns more than ``yarn_beta`` times is kept, linear between.
    Each axis uses its own ratio; a frequency's band is read from its magnitude ``|(f_x, f_y)|``.
    """
    if method not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope scaling {method!r}; choose one of {', '.join(ROPE_SCALINGS)}")
    lead = ratio.shape[:-1]
    s = ratio.clamp(min=1.0).reshape(*lead, 2, *([1] * (freqs.dim() - 1)))  # (*S, 2, 1.., 1)
    if method == "none":
        return torch.ones_like(s).expand(*lead, *freqs.shape)
    if method == "pi":
        return (1 / s).expand(*lead, *freqs.shape)
    mag = freqs.norm(dim=0, keepdim=True)  # (1, *F, P)
    if method == "ntk":
        live = mag > 0
        hi = torch.where(live, mag, mag.new_tensor(0.0)).amax()
        lo = torch.where(live, mag, mag.new_tensor(float("inf"))).amin()
        r = (torch.log(hi / mag.clamp(min=1e-30)) / torch.log(hi / lo).clamp(min=1e-12)).clamp(0, 1)
        return s ** -r
    turns = ref_extent.reshape(2, *([1] * (freqs.dim() - 1))).to(mag) * mag / (2 * math.pi)  # (2, *F, P)
    gamma = ((turns - yarn_alpha) / (yarn_beta - yarn_alpha)).clamp(0, 1)
    return (1 - gamma) / s + gamma


def yarn_temperature(ratio: Tensor) -> Tensor:
    """YaRN's attention temperature (Peng et al., ICLR 2024): q and k are scaled by ``0.1 ln s + 1``, with ``s`` the
    length ratio; in 2D the geometric mean of the axes' ratios (``ratio`` ``(..., 2)``) -> ``(...)``."""
    s = ratio.clamp(min=1.0).log().mean(-1).exp()
    return 0.1 * torch.log(s) + 1


def p_rope_keep(freqs: Tensor, fraction: float) -> Tensor:
    """p-RoPE (Barbero et al., ICLR 2025): ``(2, *F, P) -> (*F, P)`` float mask that zeroes the ``fraction`` of each
    head's lowest frequencies (by magnitude), leaving those pairs unrotated: semantic channels that position never
    perturbs, robust at long range."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"p_rope must be a fraction in [0, 1], got {fraction}")
    mag = freqs.norm(dim=0)  # (*F, P)
    n = int(round(fraction * int(mag.shape[-1])))  # int(): a traced size in an exported graph, fixed there
    keep = torch.ones_like(mag)
    if n:
        keep.scatter_(-1, mag.argsort(-1)[..., :n], 0.0)
    return keep


# ---- rotations as matrix exponentials of skew-symmetric generators (LieRE, ComRoPE), and applying block rotations -

def skew(w: Tensor) -> Tensor:
    """``w - w^T`` over the last two dimensions: the skew-symmetric matrices, generators of rotations."""
    return w - w.transpose(-1, -2)


def generator_rotations(coords: Tensor, gens: Tensor) -> Tensor:
    """``exp(x A_x + y A_y)``: ``(*B, N, 2), (2, *F, K, b, b) -> (*B, *F, N, K, b, b)`` block rotations (LieRE, Ostmeier
    et al., ICML 2025). Orthogonal for skew-symmetric generators; if the generators of a block commute, as ComRoPE's
    do, ``R(p)^T R(p') = R(p' - p)`` and attention depends only on the offset."""
    n_f = gens.dim() - 4  # the generators' own dimensions (heads, ...)
    lead, n = coords.shape[:-2], coords.shape[-2]
    x = coords[..., 0].reshape(*lead, *([1] * n_f), n, 1, 1, 1)
    y = coords[..., 1].reshape(*lead, *([1] * n_f), n, 1, 1, 1)
    return torch.linalg.matrix_exp(x * gens[0].unsqueeze(-4) + y * gens[1].unsqueeze(-4))


def rotate_blocks(x: Tensor, rot: Tensor) -> Tensor:
    """Apply block rotations: ``x`` ``(..., T, K*b)``, ``rot`` ``(..., T, K, b, b)`` broadcasting -> ``(..., T, K*b)``."""
    b = rot.shape[-1]
    return (rot @ x.unflatten(-1, (-1, b)).unsqueeze(-1)).squeeze(-1).flatten(-2)


def blocks_to_dense(rot: Tensor) -> Tensor:
    """``(..., K, b, b)`` block rotations as the ``(..., K*b, K*b)`` block-diagonal matrix they form. Rotating a batch
    by one dense matrix per token is a few large matrix products (``rotate_dense``), several times faster on CPU than
    thousands of ``b x b`` ones."""
    k, b = rot.shape[-3], rot.shape[-1]
    eye = torch.eye(k, device=rot.device, dtype=rot.dtype)
    return torch.einsum("...kij,kl->...kilj", rot, eye).reshape(*rot.shape[:-3], k * b, k * b)


def rotate_dense(x: Tensor, rot: Tensor) -> Tensor:
    """``x`` ``(..., H, T, d)`` rotated by one matrix per head and token, ``rot`` ``(H|1, T, d, d)`` -> ``(..., H, T, d)``.
    Every leading dimension of ``x`` joins one matrix product (rotate q and k stacked: one product, not two)."""
    return torch.einsum("htij,...htj->...hti", rot.expand(x.shape[-3], *rot.shape[1:]), x)
