"""Absolute encodings added to the patch tokens: none, sin-cos, Fourier features, learned table."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..coords import PatchGrid, Size2, patch_units
from .base import PosEmbed
from .functional import fourier_features, sincos_2d
from .registry import register_pos_embed

__all__ = ["NoPosEmbed", "SinCos2d", "FourierPosEmbed", "LearnedFourierPosEmbed", "LearnedPosEmbed"]


@register_pos_embed("none")
class NoPosEmbed(PosEmbed):
    """No positional encoding: self-attention is permutation-equivariant, so the model sees a bag of
    patches (the baseline that shows why PE exists)."""

    reads_coords = False


@register_pos_embed("sincos2d")
class SinCos2d(PosEmbed):
    """Fixed 2D sin-cos encoding (Vaswani et al. 2017; 2D as in MAE, He et al. 2022, and "Better plain
    ViT baselines", Beyer et al. 2022), evaluated at continuous coordinates: ``sincos_2d(coords, dim)``."""

    acts_on = "tokens"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, base: float = 10000.0) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if dim % 4:
            raise ValueError(f"sincos2d needs dim divisible by 4, got dim={dim}")
        self.base = float(base)

    def tokens(self, grid: PatchGrid) -> Tensor:
        return self.memo(grid, "tokens", lambda: sincos_2d(grid.coords, self.dim, self.base))


@register_pos_embed("fourier")
class FourierPosEmbed(PosEmbed):
    """Random Gaussian Fourier features (Tancik et al., NeurIPS 2020): ``[cos 2 pi Bc, sin 2 pi Bc]`` with
    ``B ~ N(0, sigma^2)`` fixed at construction (saved in the state dict so a checkpoint reproduces it).

    ``sigma`` is in cycles per reference patch: 0.5 is the grid's Nyquist rate, so the default 0.2 keeps
    most frequencies resolvable on the reference grid.
    """

    acts_on = "tokens"

    def __init__(
        self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, sigma: float = 0.2, seed: Optional[int] = None
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if dim % 2:
            raise ValueError(f"fourier needs an even dim (cos and sin halves), got dim={dim}")
        if sigma <= 0:
            raise ValueError(f"fourier sigma must be positive, got {sigma}")
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        self.sigma = float(sigma)
        self.register_buffer("freqs", torch.randn(dim // 2, 2, generator=gen) * sigma)  # (dim/2, 2) B

    def tokens(self, grid: PatchGrid) -> Tensor:
        return self.memo(grid, "tokens", lambda: fourier_features(grid.coords, self.freqs.float()))


@register_pos_embed("fourier_learned")
class LearnedFourierPosEmbed(PosEmbed):
    """Learnable Fourier features + MLP (Li et al., "Learnable Fourier Features for Multi-Dimensional
    Spatial Positional Encoding", NeurIPS 2021): ``MLP(1/sqrt(F) [cos 2 pi Wc, sin 2 pi Wc])`` with ``W``
    trained, initialised ``N(0, sigma^2)`` in cycles per reference patch."""

    acts_on = "tokens"

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ref_grid: Size2,
        depth: int = 1,
        *,
        fourier_dim: int = 64,
        hidden_dim: Optional[int] = None,
        sigma: float = 0.2,
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if fourier_dim % 2:
            raise ValueError(f"fourier_learned needs an even fourier_dim, got {fourier_dim}")
        hidden_dim = hidden_dim or dim
        self.freqs = nn.Parameter(torch.randn(fourier_dim // 2, 2) * sigma)  # (F/2, 2) W_r
        self.mlp = nn.Sequential(nn.Linear(fourier_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))
        self.scale = fourier_dim**-0.5

    def tokens(self, grid: PatchGrid) -> Tensor:
        coords = grid.coords.to(self.freqs)
        return self.mlp(fourier_features(coords, self.freqs) * self.scale)


@register_pos_embed("learned")
class LearnedPosEmbed(PosEmbed):
    """Learned absolute table at the reference grid (ViT, Dosovitskiy et al. 2021), sampled bicubically at
    other coordinates, the continuous form of timm's ``resample_abs_pos_embed``. Positions beyond the table
    (extrapolate mode) take the border value: a learned table knows nothing past what it was trained on.

    ``antialias=True`` resizes the table as timm does by default (``F.interpolate(bicubic, antialias=True)``,
    which is another bicubic kernel even when upsampling); the papers' code (ViT, DeiT, RoPE-ViT) does not.
    It resizes to a whole grid, so it needs plain interpolate-mode coordinates.
    """

    acts_on = "tokens"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, std: float = 0.02, antialias: bool = False) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        self.table = nn.Parameter(torch.zeros(1, dim, *self.ref_grid))  # (1, dim, h, w)
        trunc_normal_(self.table, std=std)
        self.antialias = bool(antialias)

    def tokens(self, grid: PatchGrid) -> Tensor:
        if grid.is_reference:
            return self.table.flatten(2)[0].t()  # (N, dim): exactly the trained table
        if self.antialias:
            if grid.batched or grid.mode not in ("interpolate", "normalize") or grid.affine is not None:
                raise ValueError(
                    "learned.antialias=True resizes the table to the whole grid (timm's resample), which needs plain "
                    f"interpolate-mode coordinates; got coord mode {grid.mode} {'with augmentation' if grid.affine else ''}".rstrip()
                )
            return F.interpolate(self.table, size=grid.size, mode="bicubic", antialias=True, align_corners=False).flatten(2)[0].t()
        rh, rw = self.ref_grid
        c = patch_units(grid.coords.to(self.table.device), grid)  # (..., N, 2)
        # grid_sample(align_corners=False) puts pixel j's centre at normalised (2j + 1) / size - 1.
        norm = torch.stack([(2 * c[..., 0] + 1) / rw - 1, (2 * c[..., 1] + 1) / rh - 1], dim=-1)
        out = F.grid_sample(
            self.table, norm.reshape(1, 1, -1, 2).to(self.table.dtype), mode="bicubic", padding_mode="border", align_corners=False
        )  # (1, dim, 1, *N)
        return out[0, :, 0].t().reshape(*c.shape[:-1], self.dim)

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """timm's ``pos_embed`` (ViT, DeiT, RoPE-ViT "+APE") becomes the table."""
        pos = weights.get("pos_embed")
        if pos is None:
            return {}
        h, w = self.ref_grid
        if tuple(pos.shape) != (1, h * w, self.dim):
            raise ValueError(f"timm pos_embed {tuple(pos.shape)} does not fit a learned table of {h}x{w} positions and dim {self.dim}")
        return {"table": rearrange(pos, "1 (h w) d -> 1 d h w", h=h)}
