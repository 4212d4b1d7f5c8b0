"""What a positional encoding computes, as numbers: its matrix, similarity maps, and mean attention distance."""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..coords import PatchGrid, Size2, grid_cells, to_2tuple
from ..engine import score_bytes
from ..pos_embed import PosEmbed
from ..vit import VisionTransformer

__all__ = ["pe_matrix", "pe_similarity", "attention_distance", "attention_stats"]


def _grid(pe: PosEmbed, grid_size: Size2, mode: str) -> PatchGrid:
    return PatchGrid.create(grid_size, pe.ref_grid, mode)


def _rotated(pe: PosEmbed, ctx, basis: Tensor) -> Tensor:
    """``basis`` ``(M, head_dim)`` rotated at every token by every head, layer 0: ``(M, heads, N, head_dim)``. One
    picture for every rotary family, whether it rotates pairs (RoPE) or blocks (LieRE, ComRoPE), mixed (STRING) or not."""
    n = ctx.grid.coords.shape[0]
    q = basis[:, None, None, :].expand(-1, pe.num_heads, n, -1).contiguous()
    return ctx.rotate(q, q, 0)[0]


def _bias(pe: PosEmbed, ctx) -> Optional[Tensor]:
    """``(heads, N, N)``: what layer 0 adds to the logits for position (None: nothing): its bias (layer 0's for a
    per-layer one), plus, for an encoding that computes query-key features from the tokens (PaPE), the term a query
    whose token is zero adds, scaled as the logits are."""
    out = None if ctx.bias is None else (ctx.bias[0] if ctx.mask_per_layer else ctx.bias).float()
    if ctx.extenders:
        n = ctx.grid.coords.shape[0]
        blank = torch.zeros(1, pe.num_heads, n, 1, device=ctx.grid.coords.device)
        q, k, _ = ctx.extend(blank, blank, torch.zeros(1, n, pe.dim, device=blank.device), 0)
        term = (q @ k.transpose(-2, -1))[0].float() / math.sqrt(pe.head_dim)
        out = term if out is None else out + term
    return out


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
        bias = _bias(pe, ctx)
        if bias is not None:
            out["bias"] = bias
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
        bias = _bias(pe, ctx)
        if bias is not None:
            out["bias"] = bias[:, q].view(-1, h, w)
        if pe.rotary:
            r = _rotated(pe, ctx, torch.eye(pe.head_dim, device=g.coords.device))  # (hd, heads, N, hd): R_t e_i
            out["rotary"] = torch.einsum("ihd,ihnd->hn", r[:, :, q], r).div(pe.head_dim).float().view(-1, h, w)
    if not out:
        raise ValueError(f"positional encoding {pe.name!r} has no position table to draw (it is conditional on the tokens, or none)")
    return out


@torch.no_grad()
def attention_stats(model: VisionTransformer, images: Tensor, patch_size: Optional[int] = None, chunk: int = 32,
                    max_bytes: int = 2**29) -> Dict[str, Tensor]:
    """How far and how broadly each layer and head attends, on ``images`` ``(B, C, H, W)`` at their own size.
    Returns ``(depth, heads)`` tensors (CPU, float32), averaged over patch queries and images:

    - ``distance``: mean attention distance in input pixels (Dosovitskiy et al. 2021, Fig. 7): for each patch query,
      the attention-weighted distance to the patch keys. Attention to prefix tokens is left out and the rest
      renormalised; a query that puts (numerically) all its attention on prefix tokens has no patch distance and is
      left out of the mean (NaN only where every query of a head does so);
    - ``entropy``: the attention distribution's entropy in nats over every key, prefix tokens included;
    - ``entropy_norm``: that entropy over ``log(keys)``: 1 is uniform attention, 0 one key. The quantity whose collapse
      the length-extrapolation studies blame when a model fails far from its training size.

    Tokens are those the model computes with (``content_keep`` selects per image; distances use each token's own
    patch). ``patch_size`` runs the model with a resized patch embedding (FlexiViT). ``chunk`` bounds memory: the
    explicit attention of at most ``chunk`` images at a time, fewer where their attention maps would pass ``max_bytes``."""
    if images.dim() != 4:
        raise ValueError(f"attention_stats takes an image batch (B, C, H, W), got shape {tuple(images.shape)}")
    was_training = model.training
    model.eval()
    p, ps = model.num_prefix_tokens, patch_size or model.patch_size
    depth, heads = len(model.blocks), model.blocks[0].attn.num_heads
    dist_sum, dist_n, ent_sum, ent_norm_sum = (torch.zeros(depth, heads, dtype=torch.float64) for _ in range(4))
    queries = 0
    keys = model.embed(images[:1], patch_size=patch_size)[0].shape[1]
    chunk = max(1, min(chunk, max_bytes // score_bytes(heads, keys)))  # logits, softmax and a product alive at once
    for s in range(0, len(images), chunk):
        x, pos = model.embed(images[s : s + chunk], patch_size=patch_size)
        grid = pos.grid
        cells = grid.cells if grid.batched else grid_cells(grid.size, x.device)[None]  # (B or 1, N, 2) (column, row)
        centres = cells.float() * ps
        dist = torch.cdist(centres, centres)  # (B or 1, N, N) pixels
        inputs = [x, *model.run_blocks(x, pos)][:-1]  # what each block sees
        for i, (blk, h) in enumerate(zip(model.blocks, inputs)):
            attn = blk.attn.attention_logits(blk.norm1(h), pos, i).float().softmax(-1)  # (B, H, T, T)
            ent = -torch.xlogy(attn[:, :, p:], attn[:, :, p:]).sum(-1)  # (B, H, N): 0 log 0 = 0 under a mask
            ent_sum[i] += ent.sum(dim=(0, 2)).double().cpu()
            ent_norm_sum[i] += (ent / math.log(keys)).sum(dim=(0, 2)).double().cpu() if keys > 1 else 0.0
            patch = attn[:, :, p:, p:]
            mass = patch.sum(-1)  # (B, H, N): attention left on patches
            has = mass > 1e-6
            per_query = (patch * dist[:, None]).sum(-1) / mass.clamp(min=1e-6)
            dist_sum[i] += torch.where(has, per_query, torch.zeros_like(per_query)).sum(dim=(0, 2)).double().cpu()
            dist_n[i] += has.sum(dim=(0, 2)).double().cpu()
        queries += x.shape[0] * (x.shape[1] - p)
    model.train(was_training)
    return {"distance": torch.where(dist_n > 0, dist_sum / dist_n.clamp(min=1), torch.full_like(dist_sum, float("nan"))).float(),
            "entropy": (ent_sum / max(queries, 1)).float(), "entropy_norm": (ent_norm_sum / max(queries, 1)).float()}


def attention_distance(model: VisionTransformer, images: Tensor) -> Tensor:
    """Mean attention distance per layer and head in input pixels, ``(depth, heads)``: :func:`attention_stats`'s
    ``distance``."""
    return attention_stats(model, images)["distance"]
