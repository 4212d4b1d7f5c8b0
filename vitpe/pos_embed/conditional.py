"""Conditional encodings: position computed from the tokens' own neighbourhood."""
from __future__ import annotations

from typing import FrozenSet, Sequence

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
    position, and the convolution runs on any grid, so a new resolution needs nothing special."""

    acts_on = "tokens (conditional)"

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
        h, w = grid.size
        img = rearrange(x, "b (h w) c -> b c h w", h=h, w=w)
        return x + rearrange(self.convs[str(layer)](img), "b c h w -> b (h w) c")
