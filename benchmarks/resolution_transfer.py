#!/usr/bin/env python
"""The resolution-transfer study: train every PE family with one recipe, evaluate each at 0.5x-4x.

    python benchmarks/resolution_transfer.py                       # shapes and Fashion-MNIST, every family
    python benchmarks/resolution_transfer.py --data shapes --pes rope_mixed learned --epochs 4
    python benchmarks/resolution_transfer.py --smoke               # seconds: checks the script still runs

Runs go to OUT/runs/DATA-NAME (an existing run is reused, so an interrupted study resumes where it
stopped); results to OUT/results.json, OUT/results.csv, OUT/table.md and OUT/DATA.png, merged with the
results already there (the (dataset, PE) pairs measured again are replaced).
Resolutions: each scale x training size, rounded to the nearest multiple of the patch size for the
coordinate route, and to the nearest multiple of the token grid for the patch-resize (FlexiViT) route.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

import vitpe
from vitpe.checkpoint import checkpoint_config, model_from_checkpoint
from vitpe.coords import snap
from vitpe.evaluation import dataset_of, evaluate_at
from vitpe.evaluation import plot as plot_accuracy
from vitpe.runs import safe_name, train_or_reuse, write_csv

ROOT = Path(__file__).resolve().parents[1]

SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 4.0)
CONFIGS = {"shapes": ROOT / "configs" / "shapes.yaml", "fashion_mnist": ROOT / "configs" / "fashion_mnist.yaml"}
# Beyond the plain families: the configurations built for resolution robustness.
ROBUST = {
    "rope_mixed+multires": ["--pe", "rope_mixed", "--set", "train.resolution_range=[16, 64]"],
    "sincos2d+multires": ["--pe", "sincos2d", "--set", "train.resolution_range=[16, 64]"],
}


def train_one(data: str, name: str, extra: List[str], args, runs: Path) -> Path:
    cmd = ["--config", str(args.config or CONFIGS[data]), *extra, "--set", f"train.seed={args.seed}"]
    for key, value in (("train.epochs", args.epochs), ("data.train_size", args.train_size), ("data.test_size", args.test_size)):
        if value is not None:
            cmd += ["--set", f"{key}={value}"]
    for item in args.set:
        cmd += ["--set", item]
    return train_or_reuse(runs / safe_name(f"{data}-{name}"), cmd, f"{data} {name}")


def evaluate_run(run: Path, data: str, name: str, args) -> List[Dict]:
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    size, patch = cfg.model.img_size, model.patch_size
    ref = model.ref_grid[0]
    ds = dataset_of(cfg, test_size=args.eval_size)
    rows = []
    modes = ["interpolate", "extrapolate"] if name not in ("none", "peg") else ["interpolate"]  # both modes agree without coordinates
    for scale in SCALES:
        plan = [(m, "coords", (snap(scale * size, patch),) * 2) for m in modes]
        plan.append(("interpolate", "patch", (snap(scale * size, ref),) * 2))
        for r in evaluate_at(model, ds, plan, torch.device("cpu"), desc=f"{data} {name}"):
            label = f"{name} ({r['coord_mode']})" if r["route"] == "coords" else f"{name} (patch resize)"
            rows.append({"data": data, "pe": name, "coord_mode": r["coord_mode"], "route": r["route"], "label": label, "scale": scale,
                         "resolution": r["resolution"], "height": r["height"], "width": r["width"], "train_size": size, "top1": r["top1"],
                         "loss": r["loss"], "n": r["n"], "seconds": r["seconds"], "run": str(run), "chance": 1 / ds.num_classes})
            print(f"[{data} {name}] {label:<40} {r['height']:>4}px ({scale}x): top-1 {100 * r['top1']:.2f}")
    return rows


def write_outputs(rows: List[Dict], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    write_csv(rows, out / "results.csv")
    lines = []
    for data in dict.fromkeys(r["data"] for r in rows):
        sub = [r for r in rows if r["data"] == data]
        lines += [f"### {data}", "", "| PE (coordinates / route) | " + " | ".join(f"{s}x" for s in SCALES) + " | 2x - 1x |",
                  "| --- | " + " | ".join("---:" for _ in SCALES) + " | ---: |"]
        for label in dict.fromkeys(r["label"] for r in sub):
            cells = {r["scale"]: r for r in sub if r["label"] == label}
            acc = [f"{100 * cells[s]['top1']:.1f} ({cells[s]['resolution']})" if s in cells else "-" for s in SCALES]
            drop = 100 * (cells[2.0]["top1"] - cells[1.0]["top1"]) if 2.0 in cells and 1.0 in cells else float("nan")
            lines.append(f"| {label} | " + " | ".join(acc) + f" | {drop:+.1f} |")
        lines.append("")
        # The plot: the coordinate route in interpolate mode (the patch route is nearly flat: see the table).
        plot_accuracy([r for r in sub if r["route"] == "coords" and r["coord_mode"] == "interpolate"],
                         out / f"{data}.png", f"top-1 against resolution, {data} (trained at {sub[0]['train_size']}px)")
    (out / "table.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=["shapes", "fashion_mnist"], choices=list(CONFIGS))
    p.add_argument("--pes", nargs="+", help="families and/or robust configurations (default: all of both)")
    p.add_argument("--config", help="override the per-dataset config")
    p.add_argument("--epochs", type=int)
    p.add_argument("--train-size", type=int)
    p.add_argument("--test-size", type=int)
    p.add_argument("--eval-size", type=int, default=1000, help="test images per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    p.add_argument("--out", default=str(ROOT / "docs" / "resolution_transfer"))
    p.add_argument("--smoke", action="store_true", help="tiny config, two PEs, shapes only: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.data, args.config, args.eval_size = ["shapes"], ROOT / "configs" / "tiny.yaml", 32
        args.pes = args.pes or ["learned", "rope_mixed+multires"]
        args.set = args.set + ["train.epochs=1"]
    args.pes = args.pes or vitpe.list_pos_embeds() + list(ROBUST)
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    # Earlier results (other datasets or PEs) are kept; only the (data, pe) pairs measured now are replaced.
    previous = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    started, rows = time.time(), []
    for data in args.data:
        for name in args.pes:
            extra = ROBUST.get(name, ["--pe", name])
            if args.smoke and name in ROBUST:
                extra = [e.replace("[16, 64]", "[8, 24]") for e in extra]
            run = train_one(data, name, extra, args, runs)
            rows += evaluate_run(run, data, name, args)
            done = {(r["data"], r["pe"]) for r in rows}
            write_outputs([r for r in previous if (r["data"], r["pe"]) not in done] + rows, out)  # a partial study stays readable
    print(f"study done in {(time.time() - started) / 60:.1f} min: {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
