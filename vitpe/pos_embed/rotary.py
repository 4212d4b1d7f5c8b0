"""Rotary encodings (q and k rotated by angles linear in the coordinates): 2D axial and mixed RoPE."""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor, nn

from ..coords import PatchGrid, Size2
from .base import PosEmbed
from .functional import axial_rope_freqs, mixed_rope_freqs, rope_angles
from .registry import register_pos_embed

__all__ = ["RopeAxial", "RopeMixed"]


@register_pos_embed("rope_axial")
class RopeAxial(PosEmbed):
    """2D axial RoPE (Heo et al., "Rotary Position Embedding for Vision Transformer", ECCV 2024): half the
    rotary pairs of every head turn with x, half with y, frequencies ``theta^(-4i/head_dim)``. Because q
    and k are rotated by angles linear in the coordinates, ``q . k`` depends only on their offset."""

    acts_on = "q and k"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, theta: float = 100.0) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        self.theta = float(theta)
        self.register_buffer("freqs", axial_rope_freqs(self.head_dim, self.theta), persistent=False)  # (2, head_dim/2)

    def rope_angles(self, grid: PatchGrid) -> Tensor:
        return self.memo(grid, "angles", lambda: rope_angles(grid.coords.to(self.freqs.device), self.freqs.float()))  # (N, hd/2)


@register_pos_embed("rope_mixed")
class RopeMixed(PosEmbed):
    """RoPE-Mixed (Heo et al., ECCV 2024): learnable frequencies per head (and per layer by default) that
    mix x and y, so a head can attend along diagonals. Angles are ``x f_x + y f_y``; still a rotation
    linear in the coordinates, so the relative property holds for any learned frequencies."""

    acts_on = "q and k"

    def __init__(
        self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, theta: float = 10.0, per_layer: bool = True
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        layers = depth if per_layer else 1
        freqs = torch.stack([mixed_rope_freqs(self.head_dim, num_heads, theta) for _ in range(layers)], dim=1)
        self.freqs = nn.Parameter(freqs)  # (2, L, H, head_dim/2)
        self.theta, self.per_layer = float(theta), per_layer

    def rope_angles(self, grid: PatchGrid) -> Tensor:
        return rope_angles(grid.coords.to(self.freqs.device), self.freqs)  # (L, H, N, hd/2)

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """RoPE-ViT's mixed frequencies (timm's ``rope.freqs``, ``(2, depth, heads, head_dim/2)``, x then y)."""
        return self._timm_weight(weights, "rope.freqs", self.freqs, "rope_mixed.freqs")
