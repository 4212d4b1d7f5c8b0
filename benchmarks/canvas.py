#!/usr/bin/env python
"""A larger image with the content at its trained scale: what a model trained on ``shapes`` loses to the larger grid
alone, against a native rendering at the same size, where the content's scale changes too.

    python -m benchmarks.canvas docs/resolution_transfer/runs/shapes-peg-seed0-e48 --margins 1 2 4
    python -m benchmarks.canvas --smoke                       # seconds: trains a tiny run and measures it

Each test scene is drawn at its trained pixel scale in the middle of a canvas continuing its own background, with a
margin of M patches on every side (``vitpe.data.shapes.on_canvas``), and the scene's patches get exactly the
coordinates they had in training (the integer grid continued, shifted by M). A model that reads only relative
positions then computes, for the scene's tokens, what it did at 1x, except for what they attend to outside it.
Four readings per margin: the model as trained (mean over every patch token); pooling only the scene's tokens
(is the loss the pooling's, over more background?); every attention restricted to the scene's keys (with a relative
PE, the 1x computation but for what a convolution such as PEG's sees across the scene's border); and every
attention's logits scaled by ``log(keys) / log(keys in training)`` (a length-dependent temperature that keeps
attention from spreading over more keys). The same two readings (as trained, temperature) are taken on the native rendering at the canvas's size, in the
model's own coordinate mode: the study's 2x and 4x cells when the canvas is 2x or 4x. Results merge into
OUT/canvas.json (one row per run and margin) and OUT/canvas.md; OUT defaults to docs/resolution_transfer/canvas.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from benchmarks.studykit import SDPA, sdpa_override, train_smoke
from vitpe.checkpoint import CheckpointError, checkpoint_config, model_from_checkpoint
from vitpe.coords import PatchGrid
from vitpe.data.datasets import SHAPES_SEED
from vitpe.data.shapes import on_canvas, render_shapes, shapes_params
from vitpe.evaluation import dataset_of, evaluate

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "resolution_transfer" / "canvas"
READINGS = ("canvas", "canvas_scene_pool", "canvas_scene_keys", "canvas_logn", "native", "native_logn")


def attention_override(train_keys: Optional[int] = None, keys: Optional[Tensor] = None) -> contextlib.AbstractContextManager:
    """Inside, vitpe's attention scales its logits by ``log(keys) / log(train_keys)`` (1 at the training length)
    where ``train_keys`` is given, and attends only to the patch tokens in ``keys`` (a bool mask; prefix tokens are
    always kept) where that is given (``studykit.sdpa_override``: it raises if no attention was reached)."""
    def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, *args, **kwargs) -> Tensor:
        if train_keys is not None:
            kwargs["scale"] = math.log(k.shape[-2]) / math.log(train_keys) / math.sqrt(q.shape[-1])
        if keys is not None:
            keep = torch.cat([keys.new_ones(k.shape[-2] - len(keys)), keys]).to(k.device)
            only = torch.zeros(1, k.shape[-2], dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
            attn_mask = only if attn_mask is None else attn_mask.to(q.dtype) + only
        return SDPA(q, k, v, attn_mask, *args, **kwargs)

    return sdpa_override(sdpa)


class ScenePool(nn.Module):
    """``model`` with its mean pooling over only the patch tokens in ``scene`` (a bool mask over them): is a canvas's
    loss the pooling's, over more background?"""

    def __init__(self, model: nn.Module, scene: Tensor):
        super().__init__()
        self.model, self.scene = model, scene

    def forward(self, x: Tensor, grid: Optional[PatchGrid] = None) -> Tensor:
        tokens = self.model.forward_features(x, grid=grid)[:, self.model.num_prefix_tokens:]
        return self.model.head(tokens[:, self.scene].mean(1))


def top1(model: nn.Module, images: Tensor, labels: Tensor, ds, grid: Optional[PatchGrid] = None) -> float:
    """Top-1 of ``model`` on uint8 ``images`` normalized as ``ds``'s, on ``grid`` (default: the model's own)."""
    return evaluate(model, images, labels, ds.mean, ds.std, batch_size=200,
                    grid_of=None if grid is None else lambda m, x: grid)["top1"]


def run_key(run: Path) -> str:
    """How a run is named in canvas.json: relative to the repository when inside it, so a clone reads the same names."""
    path = Path(run).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def measure(run: Path, margins: List[int], n: int) -> List[Dict]:
    """One row per margin (0 included: the 1x reference) for a ``shapes`` run, every reading in ``READINGS``."""
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    if cfg.data.name != "shapes":
        raise SystemExit(f"{run} was trained on {cfg.data.name!r}: the canvas redraws shapes scenes; give a shapes run")
    ds = dataset_of(cfg)
    size, patch = cfg.model.img_size, cfg.model.patch_size
    params = shapes_params(n, seed=SHAPES_SEED[False])
    labels = params["label"]
    train_keys = model.num_prefix_tokens + model.ref_grid[0] * model.ref_grid[1]
    rows = []
    for margin in [0] + [m for m in margins if m > 0]:
        px = size + 2 * margin * patch
        cells = px // patch
        x = render_shapes(on_canvas(params, size / px), px)
        # The integer grid continued, shifted so that the scene's patches sit where they sat in training.
        grid = PatchGrid.create((cells, cells), model.ref_grid, "extrapolate").transformed(1, 1, -margin, -margin)
        inside = torch.zeros(cells, cells, dtype=torch.bool)
        inside[margin:cells - margin, margin:cells - margin] = True
        native = render_shapes(params, px)
        row = {"run": run_key(run), "pos_embed": cfg.model.pos_embed, "seed": cfg.train.seed, "margin_patches": margin,
               "px": px, "tokens": cells * cells, "n": n,
               "canvas": top1(model, x, labels, ds, grid),
               "canvas_scene_pool": top1(ScenePool(model, inside.flatten()), x, labels, ds, grid) if cfg.model.pool == "mean" else None,
               "native": top1(model, native, labels, ds)}
        with attention_override(keys=inside.flatten()):
            row["canvas_scene_keys"] = top1(model, x, labels, ds, grid)
        with attention_override(train_keys=train_keys):
            row["canvas_logn"] = top1(model, x, labels, ds, grid)
            row["native_logn"] = top1(model, native, labels, ds)
        rows.append(row)
        print(f"[{Path(run).name}] margin {margin} ({px} px): " + ", ".join(
            f"{k} {100 * row[k]:.1f}%" for k in READINGS if row[k] is not None), flush=True)
    return rows


def markdown(rows: List[Dict]) -> str:
    head = ["run", "margin (patches)", "px", "tokens"] + list(READINGS)
    lines = ["# The scene at its trained scale on a larger canvas (benchmarks/canvas.py)", "",
             "Top-1 on the first n test scenes. canvas: as trained; canvas_scene_pool: mean over the scene's tokens only; "
             "canvas_scene_keys: every attention restricted to the scene's tokens (and the prefix tokens); "
             "*_logn: attention logits times log(keys) / log(keys in training); "
             "native: the scene rendered at the canvas's size, in the model's coordinate mode.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * 2 + " ---: |" * (len(head) - 2)]
    for r in rows:
        cells = [Path(r["run"]).name, str(r["margin_patches"]), str(r["px"]), str(r["tokens"])]
        cells += ["-" if r[k] is None else f"{100 * r[k]:.1f}%" for k in READINGS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(out: Path, rows: List[Dict]) -> Path:
    """Merge ``rows`` into OUT/canvas.json (replacing the same run's and margin's) and rewrite OUT/canvas.md."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "canvas.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    again = {(r["run"], r["margin_patches"]) for r in rows}
    merged = [r for r in earlier if (r["run"], r["margin_patches"]) not in again] + rows
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(path)
    (out / "canvas.md").write_text(markdown(merged))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="run directories trained on shapes (or their checkpoint files)")
    p.add_argument("--margins", type=int, nargs="+", default=[1, 2, 4], help="patches of background on every side")
    p.add_argument("--n", type=int, default=1000, help="test scenes (the study's cells use the first 1,000)")
    p.add_argument("--out", help=f"where canvas.json and canvas.md go (default: {OUT.relative_to(ROOT)})")
    p.add_argument("--force", action="store_true", help="measure again runs already in canvas.json with these margins and n")
    p.add_argument("--smoke", action="store_true", help="train a tiny rope_axial run for one epoch and measure it")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else OUT
    if args.smoke:
        run = train_smoke(Path(args.out or tempfile.mkdtemp(prefix="canvas_")), "rope_axial", "model.pool=mean")
        args.runs, args.n, args.margins = [str(run)], 64, [1]
    if not args.runs:
        p.error("give run directories, or --smoke")
    done = json.loads((out / "canvas.json").read_text()) if (out / "canvas.json").exists() else []
    path = out / "canvas.json"
    for run in args.runs:  # each run's rows are written as it finishes: an interrupted sweep keeps them
        have = {r["margin_patches"] for r in done if r["run"] == run_key(run) and r["n"] == args.n}
        if not args.force and have >= {0, *args.margins}:
            print(f"[{Path(run).name}] already measured (--force measures it again)")
            continue
        try:
            rows = measure(Path(run), args.margins, args.n)
        except CheckpointError as e:  # missing, corrupt or not vitpe's: the library's one line, without a traceback
            raise SystemExit(str(e)) from None
        path = write(out, rows)
    print(f"wrote {path} and {out / 'canvas.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
