"""See what a positional encoding does: its matrix, the similarity map around a position, and how far
a trained model's heads attend.

    python -m vitpe.viz matrix --pe sincos2d --grid 16 --dim 128
    python -m vitpe.viz similarity --pe rope_mixed --grid 16 --query 8 8
    python -m vitpe.viz similarity --checkpoint runs/A --grid 16          # the trained PE
    python -m vitpe.viz attention-distance runs/A --resolutions 32 64

Each command writes PNGs and a JSON of the plotted numbers to --out (default: viz-TIMESTAMP).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .coords import COORD_MODES, PatchGrid, Size2, to_2tuple
from .pos_embed import PosEmbed, build_pos_embed
from .vit import VisionTransformer

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
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    centres = torch.stack([xs.flatten(), ys.flatten()], -1).float() * model.patch_size  # pixels
    dist = torch.cdist(centres, centres).to(images.device)  # (N, N)
    out = []
    inputs = [x, *model.run_blocks(x, pos)][:-1]  # what each block sees
    for i, (blk, x) in enumerate(zip(model.blocks, inputs)):
        attn = blk.attn.attention_logits(blk.norm1(x), pos, i).softmax(-1)[:, :, p:, p:]  # (B, H, N, N)
        attn = attn / attn.sum(-1, keepdim=True)
        out.append((attn * dist).sum(-1).mean(dim=(0, 2)))
    return torch.stack(out).cpu()


# ---- drawing ---------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_plot(fig, ax, title: str, path: Path) -> None:
    """Title, grid, legend, and save: the common end of every line plot."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[1]) > 6:  # many lines: legend beside the plot, not over it
        fig.set_figwidth(fig.get_figwidth() + 3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


def draw_matrix(mats: Dict[str, Tensor], title: str, path: Path) -> None:
    plt = pyplot()
    panels = [(k, m[0] if k == "bias" else m) for k, m in mats.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), dpi=110, squeeze=False)
    labels = {"tokens": ("dimension", "position (row-major)"), "bias": ("key position", "query position (head 0)"),
              "rotary": ("rotary pair (cos, sin)", "position (head 0, layer 0)")}
    for ax, (kind, m) in zip(axes[0], panels):
        im = ax.imshow(m.numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
        ax.set_xlabel(labels[kind][0])
        ax.set_ylabel(labels[kind][1])
        ax.set_title(f"{kind}")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_maps(maps: Dict[str, Tensor], query: Tuple[int, int], title: str, path: Path, max_heads: int = 6) -> None:
    plt = pyplot()
    panels = [(f"{k}" + (f" head {i}" if m.shape[0] > 1 else ""), m[i]) for k, m in maps.items() for i in range(min(m.shape[0], max_heads))]
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (name, m) in zip(axes.flat, panels):
        im = ax.imshow(m.numpy(), cmap="viridis", interpolation="nearest")
        ax.plot(query[1], query[0], marker="x", color="red", ms=8, mew=2)
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_distance(results: Dict[str, Tensor], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    for k, (label, d) in enumerate(results.items()):
        layers = torch.arange(d.shape[0]).float() + 1 + (k - (len(results) - 1) / 2) * 0.08
        for head in range(d.shape[1]):
            ax.scatter(layers, d[:, head], s=14, color=f"C{k}", label=label if head == 0 else None)
        ax.plot(layers, d.mean(1), color=f"C{k}", alpha=0.6)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    finish_plot(fig, ax, title, path)


# ---- command line ------------------------------------------------------------------------------------
def _pe_from_args(args) -> Tuple[PosEmbed, str]:
    if args.checkpoint:
        from .checkpoint import model_from_checkpoint

        model, state = model_from_checkpoint(args.checkpoint)
        return model.pos_embed, f"{state['config']['model']['pos_embed']} (trained, {Path(args.checkpoint).name})"
    ref = args.ref_grid or args.grid
    pe = build_pos_embed(args.pe, dim=args.dim, num_heads=args.heads, ref_grid=tuple(ref), depth=1)
    return pe, args.pe


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitpe.viz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("matrix", "similarity"):
        s = sub.add_parser(name)
        s.add_argument("--pe", default="sincos2d", help="registry name or combination (ignored with --checkpoint)")
        s.add_argument("--checkpoint", help="draw the trained PE of this run or checkpoint")
        s.add_argument("--grid", type=int, nargs="+", default=[16], help="token grid: N or H W")
        s.add_argument("--ref-grid", type=int, nargs="+", help="reference grid (default: --grid)")
        s.add_argument("--mode", default="interpolate", choices=list(COORD_MODES))
        s.add_argument("--dim", type=int, default=128)
        s.add_argument("--heads", type=int, default=4)
        s.add_argument("--out")
        if name == "similarity":
            s.add_argument("--query", type=int, nargs=2, metavar=("ROW", "COL"), help="default: the grid centre")
    s = sub.add_parser("attention-distance")
    s.add_argument("checkpoints", nargs="+")
    s.add_argument("--resolutions", type=int, nargs="+", help="default: the training size")
    s.add_argument("--images", type=int, default=256, help="test images to average over")
    s.add_argument("--out")
    args = p.parse_args(argv)

    out = Path(args.out or f"viz-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    if args.cmd in ("matrix", "similarity"):
        args.grid = args.grid * 2 if len(args.grid) == 1 else args.grid
        if args.ref_grid:
            args.ref_grid = args.ref_grid * 2 if len(args.ref_grid) == 1 else args.ref_grid
        pe, label = _pe_from_args(args)
        grid = tuple(args.grid)
        stem = f"{args.cmd}_{pe.name.replace('+', '-')}_{grid[0]}x{grid[1]}"
        if args.cmd == "matrix":
            mats = pe_matrix(pe, grid, args.mode)
            draw_matrix(mats, f"{label} on a {grid[0]}x{grid[1]} grid ({args.mode})", out / f"{stem}.png")
            data = {k: v.tolist() for k, v in mats.items()}
        else:
            query = tuple(args.query) if args.query else (grid[0] // 2, grid[1] // 2)
            maps = pe_similarity(pe, grid, query, args.mode)
            draw_maps(maps, query, f"{label}: similarity to position {query} ({args.mode})", out / f"{stem}.png")
            data = {"query": query, **{k: v.tolist() for k, v in maps.items()}}
        (out / f"{stem}.json").write_text(json.dumps(data))
        print(f"wrote {out / (stem + '.png')} and {stem}.json")
        return 0

    from .checkpoint import checkpoint_config, model_from_checkpoint
    from .data.augment import normalize
    from .evaluation import dataset_of

    results = {}
    for ckpt in args.checkpoints:
        model, state = model_from_checkpoint(ckpt)
        cfg = checkpoint_config(state)
        ds = dataset_of(cfg, test_size=args.images)
        for res in args.resolutions or [cfg.model.img_size]:
            model.grid_size((res, res))  # a clear error for sizes that are not multiples of the patch
            images, _ = ds.split(False, (res, res))
            d = attention_distance(model, normalize(images[: args.images], ds.mean, ds.std))
            results[f"{cfg.model.pos_embed} @ {res}px" + (f" [{Path(ckpt).name}]" if len(args.checkpoints) > 1 else "")] = d
    draw_distance(results, out / "attention_distance.png", "mean attention distance per layer (dots: heads)")
    (out / "attention_distance.json").write_text(json.dumps({k: v.tolist() for k, v in results.items()}, indent=1))
    for k, d in results.items():
        print(f"{k}: mean distance per layer (px) " + " ".join(f"{v:.1f}" for v in d.mean(1).tolist()))
    print(f"wrote {out / 'attention_distance.png'} and attention_distance.json")
    return 0


def cli() -> int:
    from .checkpoint import CheckpointError
    from .data import DataError

    try:
        return main()
    except (ValueError, CheckpointError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
