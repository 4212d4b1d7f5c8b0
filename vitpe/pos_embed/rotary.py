"""Rotary encodings (q and k rotated by angles linear in the coordinates): 2D axial, mixed, Golden-Gate and STRING
RoPE, with the extrapolation controls every rotary family shares (PI, NTK, YaRN, p-RoPE)."""
from __future__ import annotations

import math
from typing import Dict, Optional, Union

import torch
from torch import Tensor, nn

from ..coords import PatchGrid, Size2, pair, reference_extent
from .base import PEOption, PosEmbed
from .functional import ROPE_SCALINGS, p_rope_keep, rope_angles, rope_freq_scale, skew, yarn_temperature
from .registry import register_pos_embed

__all__ = ["RotaryPosEmbed", "RopeAxial", "RopeMixed", "RopeGolden", "RopeString"]


# ---- the maths of this file's families (pure functions; maths that families share: functional.py) ----

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


def cayley(s: Tensor) -> Tensor:
    """The Cayley transform ``(I - S)(I + S)^-1`` of skew-symmetric ``S`` ``(..., d, d)``: an orthogonal matrix (STRING,
    Schenck et al., ICML 2025), the identity at ``S = 0``; ``I + S`` is always invertible for skew ``S``."""
    eye = torch.eye(s.shape[-1], device=s.device, dtype=s.dtype)
    return torch.linalg.solve(eye + s, eye - s, left=False)



def length_ratio(pe: PosEmbed, grid: PatchGrid) -> Optional[Tensor]:
    """Per-axis ratio ``(w, h)`` of ``grid``'s extent to the trained (reference) extent, ``(2,)`` or per token
    ``(B, N, 2)``; ``None`` where no axis is longer than trained (interpolate and normalize modes keep the extent; a
    grid no larger than the reference on either axis has nothing to extrapolate). Augmentation's rescaling is not a
    longer image and is left out. A ratio below 1 (a shorter axis, interpolated in extend mode) counts as 1
    (``rope_freq_scale`` clamps it)."""
    if grid.mode not in ("extrapolate", "extend") or (
            not grid.batched and grid.size[0] <= pe.ref_grid[0] and grid.size[1] <= pe.ref_grid[1]):
        return None
    ref = reference_extent(pe.ref_grid, grid.mode)
    if grid.batched:
        return grid.sizes.float() / ref.to(grid.sizes.device)
    return pair(grid.size[1], grid.size[0], dtype=torch.float32) / ref


class RotaryPosEmbed(PosEmbed):
    """A rotary encoding with explicit frequencies ``(2, *F, head_dim/2)`` (``F``: layers, heads), and the extrapolation
    controls of the field, as options at build time and settable on a trained model (``eval.py --rope-scaling``):

    - ``scaling``: how frequencies adapt when an extrapolate-mode grid is longer than the reference, per axis:
      ``"none"``, ``"pi"`` (Chen et al. 2023), ``"ntk"`` (NTK-aware base scaling), ``"yarn"`` (Peng et al., ICLR
      2024; with its attention temperature). Identity on the reference grid and in interpolate or normalize mode,
      which already keep the trained extent (interpolate mode *is* position interpolation).
    - ``p_rope``: the fraction of each head's lowest frequencies left unrotated (p-RoPE, Barbero et al., ICLR 2025).
    - ``yarn_alpha``, ``yarn_beta``: YaRN's band edges, in turns over the trained extent.
    - ``offset``, ``cell_offset``: added to both coordinates before the angles, ``offset + cell_offset * spacing`` (the
      grid's distance between neighbouring patches, per axis): the frames of models that measure a patch at its corner
      rather than its centre (EVA-02: ``0.5, -0.5``; the Perception Encoder, whose first patch sits at 1: ``0.5, 0.5``).
      Patch-to-patch attention is unchanged; attention between the unrotated prefix tokens and the patches sees it.
    """

    acts_on = "q and k"
    test_options = (
        PEOption("scaling", "scaling", str, "frequencies past the trained extent (extrapolate or extend mode): "
                 + ", ".join(ROPE_SCALINGS), flag="--rope-scaling"),
        PEOption("p_rope", "p_rope", float, "fraction of each head's lowest frequencies left unrotated (p-RoPE)", flag="--p-rope"),
        PEOption("yarn_alpha", "yarn_alpha", float, "YaRN's lower band edge, in turns over the trained extent"),
        PEOption("yarn_beta", "yarn_beta", float, "YaRN's upper band edge, in turns over the trained extent"),
    )

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, scaling: str = "none",
                 p_rope: float = 0.0, yarn_alpha: float = 1.0, yarn_beta: float = 32.0, offset: float = 0.0,
                 cell_offset: float = 0.0) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        self.scaling, self.p_rope, self.offset, self.cell_offset = scaling, p_rope, float(offset), float(cell_offset)
        self._yarn_alpha, self._yarn_beta = 1.0, 32.0
        self.set_yarn_band(yarn_alpha, yarn_beta)

    @property
    def yarn_alpha(self) -> float:
        return self._yarn_alpha

    @yarn_alpha.setter
    def yarn_alpha(self, turns: float) -> None:
        self.set_yarn_band(turns, self._yarn_beta)

    @property
    def yarn_beta(self) -> float:
        return self._yarn_beta

    @yarn_beta.setter
    def yarn_beta(self, turns: float) -> None:
        self.set_yarn_band(self._yarn_alpha, turns)

    def set_yarn_band(self, alpha: float, beta: float) -> None:
        """YaRN's band edges together: finite turns with ``0 <= alpha < beta`` (the ramp between them divides by
        ``beta - alpha``; NaN or infinity would give NaN logits that score as a low accuracy, not an error)."""
        alpha, beta = float(alpha), float(beta)
        if not (math.isfinite(alpha) and math.isfinite(beta) and 0 <= alpha < beta):
            raise ValueError(f"{self.name}: YaRN's band needs finite edges with 0 <= yarn_alpha < yarn_beta, got "
                             f"yarn_alpha={alpha}, yarn_beta={beta}")
        self._yarn_alpha, self._yarn_beta = alpha, beta
        self.clear_cache()

    @property
    def scaling(self) -> str:
        return self._scaling

    @scaling.setter
    def scaling(self, method: str) -> None:
        if method not in ROPE_SCALINGS:
            raise ValueError(f"{self.name}: unknown rope scaling {method!r}; choose one of {', '.join(ROPE_SCALINGS)}")
        self._scaling = method
        self.clear_cache()

    @property
    def p_rope(self) -> float:
        return self._p_rope

    @p_rope.setter
    def p_rope(self, fraction: float) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"{self.name}: p_rope must be a fraction in [0, 1], got {fraction}")
        self._p_rope = float(fraction)
        self.clear_cache()

    def frequencies(self) -> Tensor:
        """``(2, *F, head_dim/2)`` frequencies ``(f_x, f_y)`` in radians per coordinate unit, before the controls."""
        raise NotImplementedError

    def _freqs(self) -> Tensor:
        freqs = self.frequencies()
        if self.p_rope:
            freqs = freqs * p_rope_keep(freqs.detach(), self.p_rope)
        return freqs

    def _angles(self, grid: PatchGrid) -> Tensor:
        freqs = self._freqs()
        coords = grid.coords.to(freqs.device) + self._shift(grid)
        ratio = length_ratio(self, grid) if self.scaling != "none" else None
        if ratio is None:
            return rope_angles(coords, freqs)
        ref = reference_extent(self.ref_grid, grid.mode).to(freqs)
        scale = rope_freq_scale(freqs.detach(), ratio.to(freqs), self.scaling, ref, self.yarn_alpha, self.yarn_beta)
        if not grid.batched:
            return rope_angles(coords, freqs * scale)
        f = freqs * scale  # (B, N, 2, *F, P): each token's image has its own ratio
        n_f = freqs.dim() - 2
        x = coords[..., 0].reshape(*coords.shape[:2], *([1] * (n_f + 1)))
        y = coords[..., 1].reshape(*coords.shape[:2], *([1] * (n_f + 1)))
        return (x * f[:, :, 0] + y * f[:, :, 1]).movedim(1, -2)  # (B, *F, N, P)

    def _shift(self, grid: PatchGrid) -> Union[float, Tensor]:
        if not self.cell_offset:
            return self.offset
        step = grid.step() if isinstance(grid, PatchGrid) else None
        if step is None:
            raise ValueError(f"{self.name} with cell_offset={self.cell_offset} measures patches from their corner, which needs a "
                             "regular grid: per-image or augmented coordinates have none (set cell_offset=0 to train with them)")
        return self.offset + self.cell_offset * step

    def table_floats_per_token(self) -> int:
        # a block's angles as cos, sin and their complex form: 4 numbers a rotated pair (per-block frequencies: each block's)
        return 2 * self.dim * (self.depth if getattr(self, "per_layer", False) else 1)

    def rope_angles(self, grid: PatchGrid) -> Tensor:
        if any(p.requires_grad for p in self.parameters()):
            return self._angles(grid)
        return self.memo(grid, ("angles", self.scaling, self.p_rope), lambda: self._angles(grid))

    def rope_magnitude(self, grid: PatchGrid) -> Optional[Tensor]:
        ratio = length_ratio(self, grid) if self.scaling == "yarn" else None
        if ratio is None:
            return None
        m = yarn_temperature(ratio)  # (2,) -> () or (B, N, 2) -> (B, N)
        return m.expand(grid.coords.shape[-2]) if m.dim() == 0 else m

    def extra_repr(self) -> str:
        controls = "" if self.scaling == "none" else f", scaling={self.scaling}"
        return super().extra_repr() + controls + (f", p_rope={self.p_rope}" if self.p_rope else "")


@register_pos_embed("rope_axial")
class RopeAxial(RotaryPosEmbed):
    """2D axial RoPE (Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024): half the
    rotary pairs of every head turn with x, half with y, frequencies ``theta^(-4i/head_dim)``. Because q
    and k are rotated by angles linear in the coordinates, ``q . k`` depends only on their offset.

    ``min_period``/``max_period`` give DINOv3's spectrum instead (Simeoni et al. 2025, its
    ``RopePositionEmbedding``): periods geometric between them, frequency ``2 pi / period``; with
    ``coord_mode="normalize"`` it is DINOv3's RoPE (its x and y halves in vitpe's pair order)."""

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, theta: float = 100.0,
                 min_period: Optional[float] = None, max_period: Optional[float] = None, **controls) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **controls)
        if (min_period is None) != (max_period is None):
            raise ValueError("rope_axial needs both min_period and max_period (DINOv3's spectrum), or neither (theta's)")
        self.theta, self.min_period, self.max_period = float(theta), min_period, max_period
        freqs = axial_rope_freqs(self.head_dim, self.theta) if min_period is None else period_rope_freqs(self.head_dim, min_period, max_period)
        self.register_buffer("freqs", freqs, persistent=False)  # (2, head_dim/2)

    def frequencies(self) -> Tensor:
        return self.freqs.float()


@register_pos_embed("rope_mixed")
class RopeMixed(RotaryPosEmbed):
    """RoPE-Mixed (Heo et al., ECCV 2024): learnable frequencies per head (and per layer by default) that
    mix x and y, so a head can attend along diagonals. Angles are ``x f_x + y f_y``; still a rotation
    linear in the coordinates, so the relative property holds for any learned frequencies."""

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, theta: float = 10.0,
                 per_layer: bool = True, **controls) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **controls)
        layers = depth if per_layer else 1
        freqs = torch.stack([mixed_rope_freqs(self.head_dim, num_heads, theta) for _ in range(layers)], dim=1)
        self.freqs = nn.Parameter(freqs)  # (2, L, H, head_dim/2)
        self.theta, self.per_layer = float(theta), per_layer

    def frequencies(self) -> Tensor:
        return self.freqs

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """RoPE-ViT's mixed frequencies (timm's ``rope.freqs``, ``(2, depth, heads, head_dim/2)``, x then y)."""
        return self._timm_weight(weights, "rope.freqs", self.freqs, "rope_mixed.freqs")


@register_pos_embed("rope_golden")
class RopeGolden(RotaryPosEmbed):
    """Golden-Gate RoPE (Xiong 2025, "N-dimensional RoPE"; vit-pytorch's ``GoldenGateRoPENd``): each rotary pair of
    each head turns along its own direction, drawn from the golden-ratio low-discrepancy sequence, with magnitudes
    geometric from ``min_freq`` to ``max_freq`` (radians per coordinate unit). Isotropic where axial RoPE sees only
    two directions; fixed, so it costs what axial RoPE costs."""

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, min_freq: float = 0.01,
                 max_freq: float = 1.0, **controls) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **controls)
        self.min_freq, self.max_freq = float(min_freq), float(max_freq)
        self.register_buffer("freqs", golden_rope_freqs(self.head_dim, num_heads, min_freq, max_freq), persistent=False)  # (2, H, P)

    def frequencies(self) -> Tensor:
        return self.freqs.float()


@register_pos_embed("string")
class RopeString(RotaryPosEmbed):
    """STRING, Cayley form (Schenck et al., "Learning the RoPEs", ICML 2025): RoPE between a learned orthogonal
    matrix, ``R(p) = P^T RoPE(p) P`` with ``P = cayley(S)`` per head (``S`` skew-symmetric, zero at start: plain RoPE).
    P is orthogonal, so ``(R(p) q) . (R(p') k) = (RoPE(p) P q) . (RoPE(p') P k)``: vitpe applies ``P`` to q and k and
    then rotates, and a trained model can fold ``P`` into ``W_q``, ``W_k``. Still depends only on the offset.
    Frequencies are learned per head, initialised as RoPE-Mixed's."""

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, theta: float = 10.0, **controls) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **controls)
        self.theta = float(theta)
        self.freqs = nn.Parameter(mixed_rope_freqs(self.head_dim, num_heads, theta))  # (2, H, P)
        self.generator = nn.Parameter(torch.zeros(num_heads, self.head_dim, self.head_dim))  # S = skew(generator)

    def frequencies(self) -> Tensor:
        return self.freqs

    def rope_mix(self) -> Tensor:
        return cayley(skew(self.generator))  # (H, hd, hd), orthogonal

    def onnx_refusal(self) -> Optional[str]:
        return "its Cayley transform solves a linear system (torch.linalg.solve), which ONNX has no operator for"
