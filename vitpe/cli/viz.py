"""``vitpe viz`` (``python -m vitpe.viz`` in a clone): see what a positional encoding does: its matrix, the similarity map around a position, and how far
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
import time
from pathlib import Path
from typing import List, Optional, Tuple

from ..coords import COORD_MODES
from ..errors import command_name
from ..pos_embed import PosEmbed, build_pos_embed
from ..viz import attention_distance, draw_distance, draw_maps, draw_matrix, pe_matrix, pe_similarity
from .common import parse_size, positive_int, run_cli

__all__ = ["main", "cli"]


def _pe_from_args(args) -> Tuple[PosEmbed, str]:
    if args.checkpoint:
        from ..checkpoint import model_from_checkpoint

        model, state = model_from_checkpoint(args.checkpoint)
        return model.pos_embed, f"{state['config']['model']['pos_embed']} (trained, {Path(args.checkpoint).name})"
    ref = args.ref_grid or args.grid
    pe = build_pos_embed(args.pe, dim=args.dim, num_heads=args.heads, ref_grid=tuple(ref), depth=1)
    return pe, args.pe


def _json_safe(x):
    """``x`` with every non-finite float as ``null`` (strict JSON has no NaN or infinity; LookHere masks with -inf,
    a head attending only to the class token has no patch distance)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=command_name("viz"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    s.add_argument("--resolutions", type=parse_size, nargs="+", metavar="N|HxW", help="default: the training size")
    s.add_argument("--images", type=positive_int, default=256, help="test images to average over")
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
        (out / f"{stem}.json").write_text(json.dumps(_json_safe(data)))
        print(f"wrote {out / (stem + '.png')} and {stem}.json")
        return 0

    from ..checkpoint import checkpoint_config, model_from_checkpoint
    from ..data.augment import normalize
    from ..evaluation import dataset_of

    results = {}
    for ckpt in args.checkpoints:
        model, state = model_from_checkpoint(ckpt)
        cfg = checkpoint_config(state)
        ds = dataset_of(cfg, test_size=args.images)
        for h, w in args.resolutions or [(cfg.model.img_size,) * 2]:
            model.grid_size((h, w))  # a clear error for sizes that are not multiples of the patch
            images, _ = ds.split(False, (h, w))
            d = attention_distance(model, normalize(images[: args.images], ds.mean, ds.std))
            results[f"{cfg.model.pos_embed} @ {h if h == w else f'{h}x{w}'}px" + (f" [{Path(ckpt).name}]" if len(args.checkpoints) > 1 else "")] = d
    draw_distance(results, out / "attention_distance.png", "mean attention distance per layer (dots: heads)")
    (out / "attention_distance.json").write_text(json.dumps(_json_safe({k: v.tolist() for k, v in results.items()}), indent=1))
    for k, d in results.items():  # a head with no patch attention at all (NaN) is left out of its layer's mean
        print(f"{k}: mean distance per layer (px) " + " ".join(f"{v:.1f}" for v in d.nanmean(1).tolist()))
    print(f"wrote {out / 'attention_distance.png'} and attention_distance.json")
    return 0


def cli(argv: Optional[List[str]] = None) -> int:
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)
