"""PaPE, parabolic position encoding: a position term whose shape each query's content chooses."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..coords import PatchGrid, Size2, patch_units
from .base import PosEmbed
from .registry import register_pos_embed

__all__ = ["PaPE"]


# ---- the maths of this file's families (pure functions; maths that families share: functional.py) ----

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



@register_pos_embed("pape")
class PaPE(PosEmbed):
    """PaPE (Koo Ohrstrom et al., "Where to Attend: A Principled Vision-Centric Position Encoding with Parabolas",
    arXiv 2602.01418, 2026): each head projects a patch's position onto ``parabolas`` learned directions, and a query
    adds ``sum_k -a_k d_k^2 + b_k d_k`` to its logit for a key at projected offset ``d_k``, with curvature ``a_k >= 0``
    (softplus) and slope ``b_k`` read linearly from the query's own token: content decides how sharply and in which
    direction a head looks around itself. Per block: a position projection ``(2 -> heads x parabolas)`` and a
    coefficient projection ``(dim -> 2 x heads x parabolas)``, no biases, as the authors' code. The terms ride on the
    queries and keys as ``3 parabolas + 2`` extra features per head (:func:`~vitpe.pos_embed.functional.parabolic_terms`),
    so attention stays one fused kernel; they depend only on offsets, so a larger image is more offsets of the same
    parabolas. Positions are in reference patches (the authors' patch indices at the training size); prefix tokens
    carry no position here (the authors place the class token at the origin)."""

    acts_on = "q and k (from the tokens)"
    cost_note = ("appends 3 x parabolas + 2 features to every head's queries and keys, so attention costs about "
                 "(head_dim + 3 parabolas + 2) / head_dim times as much (the paper's 50 parabolas: 152 more per head)")

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, parabolas: int = 50) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if parabolas < 1:
            raise ValueError(f"pape needs at least one parabola per head, got parabolas={parabolas}")
        self.parabolas = parabolas
        width = num_heads * parabolas
        self.position = nn.ModuleList(nn.Linear(2, width, bias=False) for _ in range(depth))
        self.coefficients = nn.ModuleList(nn.Linear(dim, 2 * width, bias=False) for _ in range(depth))

    def train_floats_per_token(self) -> int:
        # per head: 3P+2 features on q, on k and (zero padding) on v, the P coefficients' inputs and outputs; 2x measured
        return self.num_heads * (24 * self.parabolas + 12)

    def infer_floats_per_token(self) -> int:
        # per head: 3P+2 features on q, on k and (zero padding) on v, and the coefficients' 2P outputs twice (measured)
        return self.num_heads * (15 * self.parabolas + 6)

    def qk_features(self, layer: int, x: Tensor, grid: PatchGrid) -> Tuple[Tensor, Tensor]:
        h, k = self.num_heads, self.parabolas
        proj = self.position[layer]
        p = proj(patch_units(grid.coords.to(proj.weight), grid))  # ([B], N, H P)
        p = p.unflatten(-1, (h, k)).transpose(-2, -3)  # ([B], H, N, P)
        ab = self.coefficients[layer](x).unflatten(-1, (2, h, k)).permute(2, 0, 3, 1, 4)  # (2, B, H, N, P)
        return parabolic_terms(p, F.softplus(ab[0]), ab[1])  # p broadcasts over the batch; the keys' features are expanded with them

    def extra_repr(self) -> str:
        return super().extra_repr() + f", parabolas={self.parabolas}"
