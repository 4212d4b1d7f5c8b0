"""Conditional encodings: position computed from the tokens' own neighbourhood."""
from __future__ import annotations

from typing import FrozenSet, Sequence

import torch
from einops import rearrange
from torch import Tensor, nn

from ..coords import PatchGrid, Size2
from .base import PosEmbed
from .registry import register_pos_embed

__all__ = ["PEG"]


@register_pos_embed("peg")
class PEG(PosEmbed):
    """CPVT's positional encoding generator (Chu et al., "Conditional Positional Encodings for Vision
    Transformers", ICLR 2023): ``x + DWConv(x)`` on the token grid after the given blocks (CPVT found
    after the first block best). Zero padding at the borders lets the convolution infer absolute
    position, and the convolution runs on any grid, so a new resolution needs nothing special. With per-image tokens
    (dropped or packed) each image's tokens are scattered onto its grid, missing cells zero, and convolved there."""

    acts_on = "tokens (conditional)"
    reads_coords = False  # its convolution makes position out of neighbouring tokens and the zero padding at the edge

    def __init__(
        self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, layers: Sequence[int] = (0,), kernel_size: int = 3
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        layers = tuple(int(i) for i in ([layers] if isinstance(layers, int) else layers))
        bad = [i for i in layers if not 0 <= i < depth]
        if bad or not layers:
            raise ValueError(f"peg layers must be block indices in [0, {depth - 1}], got {list(layers)}")
        if kernel_size % 2 == 0:
            raise ValueError(f"peg kernel_size must be odd so the grid keeps its size, got {kernel_size}")
        self.layers = layers
        self.convs = nn.ModuleDict(
            {str(i): nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim) for i in layers}
        )

    def condition_layers(self) -> FrozenSet[int]:
        return frozenset(self.layers)

    def condition(self, layer: int, x: Tensor, grid: PatchGrid) -> Tensor:
        conv = self.convs[str(layer)]
        if not grid.batched:
            h, w = grid.size
            img = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
            return x + rearrange(conv(img), "b c h w -> b (h w) c")
        if grid.cells is None:
            raise ValueError("peg convolves over the token grid: per-image coordinates given directly (TokenGrid.from_coords) "
                             "have none; use a TokenGrid with cells (from_grid, token dropping, packing) or another PE")
        # Scatter each image's tokens onto its own zero canvas (dropped cells stay zero), convolve, gather back. A canvas
        # larger than the image adds only zeros, which is exactly the convolution's own zero padding at the border.
        b, n, d = x.shape
        h, w = grid.size
        k = grid.images_per_row
        slot = torch.zeros_like(grid.cells[..., 0]) if grid.segments is None else grid.segments
        canvas = (torch.arange(b, device=x.device)[:, None] * k + slot) * (h * w) + grid.cells[..., 1] * w + grid.cells[..., 0]
        canvas = torch.where(slot < 0, b * k * h * w, canvas).flatten()  # padding tokens: one spare cell
        flat = x.new_zeros(b * k * h * w + 1, d).index_add(0, canvas, x.reshape(b * n, d))
        img = rearrange(flat[:-1], "(m h w) c -> m c h w", m=b * k, h=h, w=w)
        out = torch.cat([rearrange(conv(img), "m c h w -> (m h w) c"), flat.new_zeros(1, d)])
        return x + out[canvas].view(b, n, d)
