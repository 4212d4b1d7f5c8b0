"""What a positional encoding computes, as numbers: its matrix, similarity maps, and mean attention distance."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from ..coords import PatchGrid, Size2, grid_cells, to_2tuple
from ..pos_embed import PosEmbed
from ..vit import VisionTransformer

__all__ = ["pe_matrix", "pe_similarity", "attention_distance"]


def _grid(pe: PosEmbed, grid_size: Size2, mode: str) -> PatchGrid:
    return PatchGrid.create(grid_size, pe.ref_grid, mode)


def _rotated(pe: PosEmbed, ctx, basis: Tensor) -> Tensor:
    """``basis`` ``(M, head_dim)`` rotated at every token by every head, layer 0: ``(M, heads, N, head_dim)``. One
    picture for every rotary family, whether it rotates pairs (RoPE) or blocks (LieRE, ComRoPE), mixed (STRING) or not."""
    n = ctx.grid.coords.shape[0]
    q = basis[:, None, None, :].expand(-1, pe.num_heads, n, -1).contiguous()
    return ctx.rotate(q, q, 0)[0]


def _bias(ctx) -> Tensor:
    """``(heads, N, N)``: layer 0's bias for a per-layer bias (LookHere)."""
    return (ctx.bias[0] if ctx.mask_per_layer else ctx.bias).float()


def pe_matrix(pe: PosEmbed, grid_size: Size2, mode: str = "interpolate") -> Dict[str, Tensor]:
    """The encoding as matrices, by what it acts on: ``tokens`` ``(N, dim)`` (position x dimension, the
    classic sin-cos picture), ``bias`` ``(heads, N, N)`` (query x key, layer 0), ``rotary`` ``(N, head_dim)``: the
    unit pairs ``(1, 0)`` rotated at each position (head 0, layer 0), which for RoPE is each pair's cos and sin.
    A conditional PE (peg) has no table."""
    g = _grid(pe, grid_size, mode)
    with torch.no_grad():
        ctx = pe.context(g)
        out = {}
        if ctx.tokens is not None:
            out["tokens"] = ctx.tokens.float()
        if ctx.bias is not None:
            out["bias"] = _bias(ctx)
        if pe.rotary:
            unit = torch.zeros(1, pe.head_dim, device=g.coords.device)
            unit[:, ::2] = 1
            out["rotary"] = _rotated(pe, ctx, unit)[0, 0].float()
    if not out:
        raise ValueError(f"positional encoding {pe.name!r} has no position table to draw (it is conditional on the tokens, or none)")
    return out


def pe_similarity(pe: PosEmbed, grid_size: Size2, query: Tuple[int, int], mode: str = "interpolate") -> Dict[str, Tensor]:
    """How every position relates to ``query = (row, col)``, as ``(maps, h, w)`` per kind:

    - ``tokens``: cosine similarity of the added encodings (one map);
    - ``bias``: the bias the query adds to each key, per head;
    - ``rotary``: ``trace(R_q^T R_k) / head_dim`` per head, how a vector rotated at the query still aligns with itself
      rotated at the key; for RoPE ``mean_i cos(angle_q,i - angle_k,i)``.
    For a relative encoding these maps move with the query unchanged: translation-invariant stripes or blobs.
    """
    h, w = to_2tuple(grid_size, "grid_size")
    r, c = query
    if not (0 <= r < h and 0 <= c < w):
        raise ValueError(f"query {query} is outside the {h}x{w} grid")
    q = r * w + c
    g = _grid(pe, (h, w), mode)
    out = {}
    with torch.no_grad():
        ctx = pe.context(g)
        if ctx.tokens is not None:
            t = torch.nn.functional.normalize(ctx.tokens.float(), dim=-1)
            out["tokens"] = (t @ t[q]).view(1, h, w)
        if ctx.bias is not None:
            out["bias"] = _bias(ctx)[:, q].view(-1, h, w)
        if pe.rotary:
            r = _rotated(pe, ctx, torch.eye(pe.head_dim, device=g.coords.device))  # (hd, heads, N, hd): R_t e_i
            out["rotary"] = torch.einsum("ihd,ihnd->hn", r[:, :, q], r).div(pe.head_dim).float().view(-1, h, w)
    if not out:
        raise ValueError(f"positional encoding {pe.name!r} has no position table to draw (it is conditional on the tokens, or none)")
    return out


@torch.no_grad()
def attention_distance(model: VisionTransformer, images: Tensor) -> Tensor:
    """Mean attention distance per layer and head, in input pixels (Dosovitskiy et al. 2021, Fig. 7):
    for each patch query, the attention-weighted distance to the patch keys, averaged over queries and
    images. Attention to prefix tokens is left out and the rest renormalised; a query that puts (numerically) all its
    attention on prefix tokens has no patch distance and is left out of the mean. Returns ``(depth, heads)``; NaN only
    where every query of a head attends to prefix tokens alone."""
    model.eval()
    x, pos = model.embed(images)
    p = model.num_prefix_tokens
    h, w = pos.grid.size
    centres = grid_cells((h, w)).float() * model.patch_size  # pixels
    dist = torch.cdist(centres, centres).to(images.device)  # (N, N)
    out = []
    inputs = [x, *model.run_blocks(x, pos)][:-1]  # what each block sees
    for i, (blk, x) in enumerate(zip(model.blocks, inputs)):
        attn = blk.attn.attention_logits(blk.norm1(x), pos, i).softmax(-1)[:, :, p:, p:]  # (B, H, N, N)
        mass = attn.sum(-1)  # (B, H, N): attention left on patches
        has = mass > 1e-6
        per_query = (attn * dist).sum(-1) / mass.clamp(min=1e-6)  # (B, H, N)
        count = has.sum(dim=(0, 2))
        total = torch.where(has, per_query, torch.zeros_like(per_query)).sum(dim=(0, 2))
        out.append(torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan"))))
    return torch.stack(out).cpu()

