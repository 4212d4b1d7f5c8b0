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


def pe_matrix(pe: PosEmbed, grid_size: Size2, mode: str = "interpolate") -> Dict[str, Tensor]:
    """The encoding as matrices, by what it acts on: ``tokens`` ``(N, dim)`` (position x dimension, the
    classic sin-cos picture), ``bias`` ``(heads, N, N)`` (query x key), ``rotary`` ``(N, head_dim)``
    (cos and sin of each pair's angle, head 0, layer 0). A conditional PE (peg) has no table."""
    g = _grid(pe, grid_size, mode)
    with torch.no_grad():
        ctx = pe.context(g)
        out = {}
        if ctx.tokens is not None:
            out["tokens"] = ctx.tokens.float()
        if ctx.bias is not None:
            out["bias"] = ctx.bias.float()
        if ctx.cos is not None:
            out["rotary"] = torch.stack([ctx.cos[0, 0], ctx.sin[0, 0]], -1).flatten(-2).float()
    if not out:
        raise ValueError(f"positional encoding {pe.name!r} has no position table to draw (it is conditional on the tokens, or none)")
    return out


def pe_similarity(pe: PosEmbed, grid_size: Size2, query: Tuple[int, int], mode: str = "interpolate") -> Dict[str, Tensor]:
    """How every position relates to ``query = (row, col)``, as ``(maps, h, w)`` per kind:

    - ``tokens``: cosine similarity of the added encodings (one map);
    - ``bias``: the bias the query adds to each key, per head;
    - ``rotary``: ``mean_i cos(angle_q,i - angle_k,i)``, the dot product of unit pairs after rotation, per head.
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
            out["bias"] = ctx.bias[:, q].float().view(-1, h, w)
        angles = pe.rope_angles(g)
        if angles is not None:
            a = angles.float()
            a = a[0] if a.dim() == 4 else a  # layer 0
            a = a if a.dim() == 3 else a.unsqueeze(0)  # (heads|1, N, P)
            out["rotary"] = torch.cos(a[:, q : q + 1] - a).mean(-1).view(-1, h, w)
    if not out:
        raise ValueError(f"positional encoding {pe.name!r} has no position table to draw (it is conditional on the tokens, or none)")
    return out


@torch.no_grad()
def attention_distance(model: VisionTransformer, images: Tensor) -> Tensor:
    """Mean attention distance per layer and head, in input pixels (Dosovitskiy et al. 2021, Fig. 7):
    for each patch query, the attention-weighted distance to the patch keys, averaged over queries and
    images. Attention to prefix tokens is left out and the rest renormalised. Returns ``(depth, heads)``."""
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
        attn = attn / attn.sum(-1, keepdim=True)
        out.append((attn * dist).sum(-1).mean(dim=(0, 2)))
    return torch.stack(out).cpu()

