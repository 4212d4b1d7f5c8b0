"""The maths of every positional encoding, as pure functions of coordinates.

No state, no modules: each function is testable alone and reusable in any model. ``coords`` is ``(..., N, 2)``
with columns ``(x, y)`` (see ``vitpe.grid_coords``): one grid ``(N, 2)`` shared by a batch, or one per image
``(B, N, 2)``; every function broadcasts over the leading dimensions, so shapes are written for one grid.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "alibi_slopes",
    "alibi2d_bias",
    "parabolic_terms",
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
    "resize_table",
    "antialias_weights",
    "sample_line",
    "period_rope_freqs",
    "golden_directions",
    "golden_rope_freqs",
    "ROPE_SCALINGS",
    "rope_freq_scale",
    "yarn_temperature",
    "p_rope_keep",
    "skew",
    "generator_rotations",
    "rotate_blocks",
    "blocks_to_dense",
    "rotate_dense",
    "commuting_lattice_rotations",
    "cayley",
    "fire_features",
    "lookhere_directions",
    "lookhere_bias",
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
    if torch.onnx.is_in_onnx_export():  # onnxruntime before 1.24 has no float64 sin/cos: the angles, then float32 trig
        phase = phase.float()
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


def resize_table(table: Tensor, size: Tuple[int, int], mode: str = "bicubic", antialias: bool = False,
                 align_corners: bool = False, square: bool = False) -> Tensor:
    """A learned table ``(1, dim, h, w)`` resized to the grid ``size`` as timm resizes it (``F.interpolate``, so its
    antialiasing and corner conventions). ``square``: resized to a square of the longer side, then its top-left
    ``size`` corner (NaFlex's aspect-preserving resize, patches keep their place whatever the shape)."""
    out_size = (max(size),) * 2 if square else tuple(size)
    if antialias and torch.onnx.is_in_onnx_export():  # ONNX has no antialiased resize: the same weights, as two products
        ry, rx = (antialias_weights(n, m, mode, table.device) for n, m in zip(out_size, table.shape[-2:]))
        out = torch.einsum("yh,bdhw,xw->bdyx", ry, table.float(), rx)
    else:
        out = F.interpolate(table.float(), size=out_size, mode=mode, antialias=antialias, align_corners=align_corners)
    return out[:, :, : size[0], : size[1]].to(table.dtype)


def antialias_weights(n_out: int, n_in: int, mode: str = "bicubic", device: Optional[torch.device] = None) -> Tensor:
    """``(n_out, n_in)`` weights of ``F.interpolate(..., antialias=True)`` along one axis (PIL's filters: Keys' cubic
    with ``a = -0.5``, or the triangle, stretched by the scale when shrinking, each row normalised to 1). Zero outside a
    filter's support, so the dense matrix is the windowed sum PyTorch computes, in ops an exported graph has."""
    i = torch.arange(n_out, device=device, dtype=torch.float32)
    j = torch.arange(n_in, device=device, dtype=torch.float32)
    scale = torch.as_tensor(n_in / n_out, dtype=torch.float32, device=device)
    x = ((j + 0.5)[None, :] - (i + 0.5)[:, None] * scale) / scale.clamp(min=1.0)
    a = x.abs()
    if mode == "bilinear":
        w = (1 - a).clamp(min=0)
    else:
        w = torch.where(a < 1, (1.5 * a - 2.5) * a * a + 1, torch.where(a < 2, ((a - 5) * a + 8) * a * -0.5 + 2.0, torch.zeros_like(a)))
    return w / w.sum(1, keepdim=True)


def sample_line(table: Tensor, pos: Tensor) -> Tensor:
    """Linear interpolation in a 1D table ``(L, dim)`` at continuous positions ``pos`` ``(...)`` in table entries,
    border values beyond it (``F.interpolate(mode="linear")``'s kernel; NaViT's factorized tables). Returns ``(..., dim)``."""
    n = table.shape[0]
    p = pos.to(table.dtype).clamp(0, n - 1)
    lo = p.floor().clamp(max=max(n - 2, 0))
    w = (p - lo).unsqueeze(-1)
    i = lo.long()
    return table[i] * (1 - w) + table[(i + 1).clamp(max=n - 1)] * w


# ---- rotary frequencies of the 2024-26 families, and their extrapolation controls ------------------------------

def period_rope_freqs(head_dim: int, min_period: float, max_period: float) -> Tensor:
    """DINOv3's axial RoPE spectrum (Simeoni et al. 2025): ``(2, head_dim/2)`` like :func:`axial_rope_freqs`, with
    ``head_dim/4`` periods geometric from ``min_period`` to ``max_period`` (in coordinate units: DINOv3 reads them in
    its box ``[-1, 1]``), frequency ``2 pi / period``. Its ``base`` form is ``axial_rope_freqs(head_dim, base) * 2 pi``."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    if not 0 < min_period <= max_period:
        raise ValueError(f"rope periods need 0 < min_period <= max_period, got {min_period}, {max_period}")
    periods = min_period * (max_period / min_period) ** torch.linspace(0, 1, head_dim // 4, dtype=torch.float64)
    mag = (2 * math.pi / periods).float()
    zero = torch.zeros_like(mag)
    return torch.stack([torch.cat([mag, zero]), torch.cat([zero, mag])])


def golden_directions(n: int, dim: int = 2) -> Tensor:
    """``n`` unit vectors in ``dim`` dimensions from the generalised golden-ratio (Kronecker, R_d) low-discrepancy
    sequence pushed through the Gaussian inverse CDF: ``(n, dim)``, evenly spread, never axis-aligned in blocks."""
    g = 2.0
    for _ in range(30):  # the unique positive root of x^(d+1) = x + 1
        g = (1 + g) ** (1 / (dim + 1))
    alpha = g ** -torch.arange(1, dim + 1, dtype=torch.float64)
    z = torch.remainder(torch.arange(1, n + 1, dtype=torch.float64)[:, None] * alpha, 1.0)
    v = torch.erfinv(2 * z - 1)
    return (v / v.norm(dim=-1, keepdim=True)).float()


def golden_rope_freqs(head_dim: int, num_heads: int, min_freq: float, max_freq: float) -> Tensor:
    """Golden-Gate RoPE (Xiong 2025, "N-dimensional RoPE"; vit-pytorch's ``GoldenGateRoPENd``): ``(2, heads, head_dim/2)``.
    Pair ``f`` of head ``h`` turns along direction ``golden_directions[h * P + f]`` with magnitude geometric from
    ``min_freq`` to ``max_freq`` (radians per coordinate unit): every pair its own direction, isotropic, not axial."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if not 0 < min_freq <= max_freq:
        raise ValueError(f"rope_golden needs 0 < min_freq <= max_freq, got {min_freq}, {max_freq}")
    p = head_dim // 2
    mag = min_freq * (max_freq / min_freq) ** torch.linspace(0, 1, p, dtype=torch.float64)
    dirs = golden_directions(num_heads * p).reshape(num_heads, p, 2)  # (H, P, 2)
    return (dirs * mag.float()[:, None]).permute(2, 0, 1).contiguous()  # (2, H, P)


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


# ---- rotations as matrix exponentials of skew-symmetric generators (LieRE, ComRoPE) and STRING's Cayley map -----

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


def commuting_lattice_rotations(xs: Tensor, ys: Tensor, gens: Tensor) -> Tensor:
    """:func:`generator_rotations` on a lattice ``(x_j, y_i)`` (row-major) when ``A_x`` and ``A_y`` commute (ComRoPE):
    ``exp(x A_x + y A_y) = exp(x A_x) exp(y A_y)``, so ``w + h`` matrix exponentials serve all ``h w`` tokens.
    ``xs`` ``(w,)``, ``ys`` ``(h,)``, ``gens`` ``(2, *F, K, b, b)`` -> ``(*F, h*w, K, b, b)``."""
    n_f = gens.dim() - 4
    ex = torch.linalg.matrix_exp(xs.reshape(-1, *([1] * (n_f + 3))) * gens[0])  # (w, *F, K, b, b)
    ey = torch.linalg.matrix_exp(ys.reshape(-1, *([1] * (n_f + 3))) * gens[1])  # (h, *F, K, b, b)
    rot = ex[None] @ ey[:, None]  # (h, w, *F, K, b, b)
    return rot.flatten(0, 1).movedim(0, -4)


def cayley(s: Tensor) -> Tensor:
    """The Cayley transform ``(I - S)(I + S)^-1`` of skew-symmetric ``S`` ``(..., d, d)``: an orthogonal matrix (STRING,
    Schenck et al., ICML 2025), the identity at ``S = 0``; ``I + S`` is always invertible for skew ``S``."""
    eye = torch.eye(s.shape[-1], device=s.device, dtype=s.dtype)
    return torch.linalg.solve(eye + s, eye - s, left=False)


# ---- biases of the 2024-26 families ------------------------------------------------------------------------------

def fire_features(offsets: Tensor, extent: Tensor, c: Tensor) -> Tensor:
    """FIRE's input (Li et al., ICLR 2024), in 2D: ``psi(d) / psi(extent)`` per axis with ``psi(d) = sign(d) log(c|d| + 1)``.
    ``offsets`` ``(..., 2)``, ``extent`` (the normaliser, the image's extent per axis, broadcasting) -> ``(..., 2)`` in
    ``[-1, 1]`` for offsets inside the image: a larger image gives a denser, not a wider, range. ``c > 0``."""
    return torch.sign(offsets) * torch.log1p(c * offsets.abs()) / torch.log1p(c * extent)


LOOKHERE_DIRECTIONS = ((0.0, -1.0), (0.0, 1.0), (-1.0, 0.0), (1.0, 0.0))  # up, down, left, right (rows grow downwards)


def lookhere_directions(num_heads: int, fov: float) -> Tensor:
    """LookHere's head directions (Fuller et al., NeurIPS 2024): ``(heads, 2)`` unit ``(x, y)``. Heads cycle through up,
    down, left, right; a field of view under 90 degrees needs the diagonals too, so eight directions are cycled."""
    if fov >= 90:
        table = torch.tensor(LOOKHERE_DIRECTIONS)
    else:
        a = torch.arange(8) * (math.pi / 4) - math.pi / 2
        table = torch.stack([a.cos(), a.sin()], -1)
    return table[torch.arange(num_heads) % len(table)]


def lookhere_bias(offsets: Tensor, directions: Tensor, fov: float, slopes: Tensor) -> Tensor:
    """LookHere (Fuller et al., NeurIPS 2024): offsets query minus key ``(..., 2)`` (:func:`relative_offsets`), head
    directions ``(H, 2)``, slopes ``(*L, H)`` -> ``(*L, ..., H)``: minus ``slope * distance`` where the key lies in the
    head's field of view (``fov`` degrees about its direction, the query itself included), ``-inf`` outside. The
    directional masks make heads look different ways; at new resolutions no head meets a direction it never saw."""
    to_key = -offsets  # from the query to the key
    dist = to_key.norm(dim=-1, keepdim=True)  # (..., 1)
    inside = to_key @ directions.t().to(to_key) >= dist * math.cos(math.radians(fov) / 2) - 1e-6  # (..., H)
    lead = slopes.shape[:-1]
    penalty = dist * slopes.reshape(*lead, *([1] * (dist.dim() - 1)), -1).to(dist)  # (*L, ..., H)
    return (-penalty).masked_fill(~inside, float("-inf"))


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al., ICLR 2022): for ``n`` a power of two, the geometric sequence ``2^(-8 k / n)``,
    ``k = 1..n``; otherwise those of the nearest power of two below, then every other slope of the next one up."""
    def powers(n: int) -> List[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    if num_heads < 1:
        raise ValueError(f"alibi needs at least one head, got {num_heads}")
    low = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(low) + powers(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi2d_bias(offsets: Tensor, slopes: Tensor) -> Tensor:
    """2D ALiBi (CROMA, Fuller et al., NeurIPS 2023): ``-slope_h * |d|``, the Euclidean length of each offset ``d``
    ``(..., 2)`` in reference patches, per head: ``(..., H)``."""
    return -offsets.norm(dim=-1, keepdim=True) * slopes.to(offsets)


def parabolic_terms(positions: Tensor, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    """PaPE's parabolas as extra query and key features (Koo Ohrstrom et al. 2026, "Where to Attend"): with projected
    positions ``p`` ``(..., N, P)`` (one scalar per parabola), a query's curvatures ``a >= 0`` and slopes ``b``
    ``(..., N, P)``, the features ``q_e = [sum a (-p^2), a, 2 a p, sum b p, b]`` and ``k_e = [1, -p^2, p, 1, -p]``
    (``3 P + 2`` each) give ``q_e . k_e = sum_k -a_k (p_q - p_k)^2 + b_k (p_q - p_k)``: a parabola in each projected
    offset, opening downwards, whose curvature and slope the query's content chooses."""
    ones = positions[..., :1].pow(0)  # ones, shaped by the positions in an exported graph too (ones_like freezes there)
    square = positions.pow(2)
    q = torch.cat([(a * -square).sum(-1, keepdim=True), a, 2 * a * positions, (b * positions).sum(-1, keepdim=True), b], -1)
    k = torch.cat([ones, -square, positions, ones, -positions], -1)
    return q, k
