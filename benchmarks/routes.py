#!/usr/bin/env python
"""A model at a new size, every route a user has, in absolute top-1 (docs/which_pe.md's answer; the record
docs/routes/results.csv). For one dataset's config: training at the sizes it will be used at (``multi``, the main
job's recipe: every multiple of the patch in [16, 48] px), training at 32 px only (``one``) and then, at each new
size, the coordinate route (new coordinates), FlexiViT's patch route, resizing the image back to 32 px, or a short
fine-tune at that size (``ftK``: ``one`` with ``--init``, one epoch of FT_IMAGES images at K px, coordinates kept).

    OMP_NUM_THREADS=1 nice python -m benchmarks.routes --data shapes --out /tmp/routes --shard 0/2 &   # two at a time
    OMP_NUM_THREADS=1 nice python -m benchmarks.routes --data shapes --out /tmp/routes --shard 1/2 &
    python -m benchmarks.routes --report          # docs/routes/table.md and the figures, from the record
    python -m benchmarks.routes --smoke           # seconds: the script still runs

A row of the record is (data, arm, seed, route, resolution): top-1 on the full test set, the run's training seconds
(and its source's, for a fine-tune), and whether its test top-1 was still moving (studykit.convergence). ``multi`` and
``one`` are measured at every size of SIZES by every route (the patch route where the trained grid fits); ``ftK`` at
K px and at 32. Runs go to OUT/runs, outside the repository: a finished run is reused, an interrupted one resumed.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from benchmarks.finetune_study import CONFIGS, finished, locked, mean_sd
from benchmarks.studykit import TrainSpec, convergence, train_or_reuse, training_time
from vitpe.checkpoint import checkpoint_config, load_checkpoint, model_from_checkpoint
from vitpe.evaluation import dataset_of, evaluate_at, patch_fits
from vitpe.runs import write_csv

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "routes" / "results.csv"
SPEED_RECORD = ROOT / "docs" / "resolution_transfer" / "results.csv"  # the routes' inference speed at each size
TRAIN_SIZE = 32
SIZES = (16, 32, 48, 64, 128)  # 0.5x, 1x, 1.5x, 2x, 4x
FINETUNES = (16, 48, 64)  # 4x (128 px) left out: about 13 minutes a seed, the plan's largest row (docs/which_pe.md)
FT_IMAGES = 10240  # one epoch at batch 64, as the fine-tuning study's ft64keep
ARMS = ("multi", "one", *(f"ft{k}" for k in FINETUNES))
FIELDS = ("data", "arm", "seed", "train_time_s", "source_time_s", "converged", "last_fifth_gain_points", "route", "resolution",
          "n", "top1")
ROUTES = ("coords", "patch", "resize")


def arm_args(data: str, arm: str, seed: int, out: Path) -> TrainSpec:
    """The run of an arm."""
    if arm in ("multi", "one"):
        return TrainSpec(str(CONFIGS[data]), (f"train.seed={seed}", "train.resolution_range=" + ("[16, 48]" if arm == "multi" else "null")))
    steps = FT_IMAGES // 64
    sets = [f"train.seed={seed}", f"data.train_size={FT_IMAGES}", f"train.steps={steps}", f"train.warmup_steps={steps // 10}",
            f"train.resolutions=[{arm[2:]}]"]
    return TrainSpec(None, (f"init.source={out / 'runs' / f'{data}-one-seed{seed}'}", *sets))


def plan_of(model, arm: str) -> List[Tuple[str, str, Tuple[int, int]]]:
    """(coord_mode, route, size) of an arm's evaluations."""
    if arm.startswith("ft"):
        return [("interpolate", "coords", (s, s)) for s in (TRAIN_SIZE, int(arm[2:]))]
    plan = [("interpolate", "coords", (s, s)) for s in SIZES]
    for s in SIZES:
        if s != TRAIN_SIZE:
            plan += [("interpolate", "patch", (s, s))] if patch_fits(model, s, s) else []
            plan.append(("interpolate", "resize", (s, s)))
    return plan


def measure(run: Path, data: str, arm: str, seed: int, source: Optional[Path], test_size: Optional[int]) -> List[Dict]:
    model, state = model_from_checkpoint(run)
    ds = dataset_of(checkpoint_config(state), test_size=test_size)
    verdict = convergence(state["metrics"])
    base = {"data": data, "arm": arm, "seed": seed, "train_time_s": verdict["train_time_s"],
            "source_time_s": round(training_time(load_checkpoint(source)["metrics"]), 1) if source else 0.0,
            "converged": verdict["converged"], "last_fifth_gain_points": verdict["last_fifth_gain_points"]}
    rows = []
    for r in evaluate_at(model, ds, plan_of(model, arm), torch.device("cpu"), desc=f"{data} {arm} s{seed}"):
        rows.append({**base, "route": r["route"], "resolution": r["height"], "n": r["n"], "top1": round(r["top1"], 5)})  # square sizes
        print(f"[{data} {arm} seed {seed}] {r['route']:<7} {r['resolution']:>4}: top-1 {100 * r['top1']:.2f}", flush=True)
    return rows


# ---- the record ----------------------------------------------------------------------------------------------------
def load_results(path: Path = RECORD) -> List[Dict]:
    if not path.is_file():
        return []
    ints, floats = {"seed", "resolution", "n"}, {"train_time_s", "source_time_s", "last_fifth_gain_points", "top1"}
    with open(path, newline="") as f:
        return [{k: int(v) if k in ints else float(v) if k in floats else (v == "True") if k == "converged" else v
                 for k, v in r.items()} for r in csv.DictReader(f)]


def save_results(rows: List[Dict], path: Path = RECORD) -> None:
    rows = sorted(rows, key=lambda r: (r["data"], ARMS.index(r["arm"]), r["seed"], ROUTES.index(r["route"]), r["resolution"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_csv([{k: r[k] for k in FIELDS} for r in rows], path)


# ---- the report ----------------------------------------------------------------------------------------------------
def verdict(row: Dict) -> Optional[bool]:
    """Whether the row's run converged; None for a run too short to have a trend (a one-epoch fine-tune: a budget)."""
    return None if row["last_fifth_gain_points"] != row["last_fifth_gain_points"] else row["converged"]


def routes_of(rows: List[Dict], data: str) -> List[Tuple[str, Dict[int, List[float]], List[float], List[Optional[bool]]]]:
    """(label, size -> top-1 (%) per seed, training minutes per seed, whether each run converged) of every route measured
    on ``data``: multi and one by each route, and "fine-tune at the size" gathering each ftK's top-1 at K."""
    out = []
    mine = [r for r in rows if r["data"] == data]
    one_at_1x = [100 * r["top1"] for r in mine if (r["arm"], r["route"], r["resolution"]) == ("one", "coords", TRAIN_SIZE)]
    for arm, route, label in [("multi", "coords", "trained at 16-48 px (multi), coordinates"),
                              ("one", "coords", "trained at 32 px (one), coordinates"), ("one", "patch", "one, patch route"),
                              ("one", "resize", "one, resized back to 32 px")]:
        cells: Dict[int, List[float]] = {}
        for r in mine:
            if (r["arm"], r["route"]) == (arm, route):
                cells.setdefault(r["resolution"], []).append(100 * r["top1"])
        if route != "coords" and TRAIN_SIZE not in cells:  # every route is the model itself at 1x
            cells[TRAIN_SIZE] = one_at_1x
        runs = [r for r in mine if (r["arm"], r["route"], r["resolution"]) == (arm, "coords", TRAIN_SIZE)]
        if cells:
            out.append((label, cells, [r["train_time_s"] / 60 for r in runs], [verdict(r) for r in runs]))
    ft: Dict[int, List[float]] = {}
    extra: List[float] = []
    settled: List[Optional[bool]] = []
    for r in mine:
        if r["arm"].startswith("ft") and r["resolution"] == int(r["arm"][2:]):
            ft.setdefault(int(r["arm"][2:]), []).append(100 * r["top1"])
            extra.append(r["train_time_s"] / 60)
            settled.append(verdict(r))
    if ft:
        ft[TRAIN_SIZE] = one_at_1x
        out.append(("one, then fine-tuned at the size (minutes: each fine-tune's)", ft, extra, settled))
    return out


def table(rows: List[Dict], data: str) -> str:
    """Absolute top-1 (%) at each size, mean ± sd over seeds, and retention (top-1 at kx over top-1 at 1x) at 2x and 4x."""
    scales = {s: f"{s / TRAIN_SIZE:g}x" for s in SIZES}
    lines = [f"| {data}: route | seeds | runs converged | training min | " + " | ".join(f"{scales[s]} ({s} px)" for s in SIZES)
             + " | retention 2x | retention 4x |", "| --- | ---: | ---: | ---: |" + " ---: |" * (len(SIZES) + 2)]
    for label, cells, minutes, settled in routes_of(rows, data):
        seeds = max(len(v) for v in cells.values())
        one = cells.get(TRAIN_SIZE, [])

        def retention(s: int) -> str:
            if not cells.get(s) or not one or len(cells[s]) != len(one):
                return "-"
            return f"{sum(a / b for a, b in zip(cells[s], one)) / len(one):.3f}"

        judged = [v for v in settled if v is not None]
        converged = f"{sum(judged)} of {len(judged)}" if judged else "- (one epoch)"
        spent = mean_sd(minutes) if not label.startswith("one, then") else f"{min(minutes):.1f} to {max(minutes):.1f}"
        lines.append(f"| {label} | {seeds} | {converged} | {spent} | " + " | ".join(mean_sd(cells.get(s, [])) for s in SIZES)
                     + f" | {retention(64)} | {retention(128)} |")
    return "\n".join(lines) + "\n"


def finetune_table(rows: List[Dict], data: str) -> str:
    """Each fine-tune: its minutes, its top-1 at its size and at 32 px afterwards (what it kept of 1x), mean ± sd."""
    lines = [f"| {data}: fine-tuned at | seeds | minutes (the source's 32-px training apart) | top-1 at that size | top-1 at 32 px after |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for k in FINETUNES:
        mine = [r for r in rows if (r["data"], r["arm"]) == (data, f"ft{k}")]
        at = {s: [100 * r["top1"] for r in mine if r["resolution"] == s] for s in (k, TRAIN_SIZE)}
        if mine:
            minutes = [r["train_time_s"] / 60 for r in mine if r["resolution"] == k]
            lines.append(f"| {k} px ({k / TRAIN_SIZE:g}x) | {len(at[k])} | {mean_sd(minutes)} | {mean_sd(at[k])} | {mean_sd(at[TRAIN_SIZE])} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def cost_table(path: Path = SPEED_RECORD) -> str:
    """What each route costs at inference, from the record that times it: images/s of the evaluation (without loading)
    of the main job's architecture trained at 32 px (`sincos2d`, shapes, in the resolution-transfer study), median over
    its seeds, by the coordinate and patch routes at each size. The speed is the architecture's and the tokens', the same
    on any data; that record times no resize (the planner's record does: routes/planner.md)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r["data"], r["row"]) == ("shapes", "sincos2d")]
    scales = {s: f"{s / TRAIN_SIZE:g}x" for s in SIZES}
    lines = ["| inference images/s (median of seeds; docs/resolution_transfer/results.csv) | seeds | "
             + " | ".join(f"{scales[s]} ({s} px)" for s in SIZES) + " |", "| --- | ---: |" + " ---: |" * len(SIZES)]
    for label, name in (("interpolate", "coordinates"), ("patch", "patch route")):
        cells = {s: [float(r["images_per_s"]) for r in rows if r["label"] == label and r["column"] == scales[s]] for s in SIZES}
        seeds = max(len(v) for v in cells.values())
        lines.append(f"| {name} | {seeds} | " + " | ".join(f"{statistics.median(v):,.0f}" if v else "-" for v in cells.values()) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: List[Dict], data: str, path: Path) -> None:
    """Top-1 against size, one line a route, mean over seeds with the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, cells, *_ in routes_of(rows, data):
        sizes = sorted(s for s in cells if cells[s])
        mean = [sum(cells[s]) / len(cells[s]) for s in sizes]
        ax.plot([s / TRAIN_SIZE for s in sizes], mean, marker="o", label=label.split(" (minutes")[0])
        ax.fill_between([s / TRAIN_SIZE for s in sizes], [min(cells[s]) for s in sizes], [max(cells[s]) for s in sizes], alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks([s / TRAIN_SIZE for s in SIZES], [f"{s / TRAIN_SIZE:g}x\n{s} px" for s in SIZES])
    ax.set_xlabel("evaluation size (multiple of the 32-px training size)")
    ax.set_ylabel("test top-1 (%)")
    ax.set_title(f"{data}: a model at a new size, every route (mean of seeds, range shaded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")  # the lower left holds the 0.5x points
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(path: Path = RECORD) -> str:
    rows = load_results(path)
    datasets = [d for d in CONFIGS if any(r["data"] == d for r in rows)]
    text = ("Generated by `python -m benchmarks.routes --report` from the record (results.csv): absolute test top-1 (%), "
            "mean ± sd over seeds; retention is top-1 at kx over top-1 at 1x, per seed, averaged. A run converged when "
            "the trend of its last fifth of epochs is under 0.3 points either way (benchmarks/studykit.py).\n\n")
    text += "".join(table(rows, d) + "\n" + finetune_table(rows, d) + "\n" for d in datasets)
    if SPEED_RECORD.is_file():
        text += cost_table() + "\n"
    (path.parent / "table.md").write_text(text)
    for d in datasets:
        figure(rows, d, path.parent / f"{d}.png")
    return text


def main(argv: Optional[List[str]] = None) -> int:
    global CONFIGS, FT_IMAGES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=list(CONFIGS), default="shapes")
    p.add_argument("--arms", nargs="+", choices=ARMS, help="default: every arm")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("/tmp/vitpe-routes"), help="where runs (checkpoints) go, outside the repository")
    p.add_argument("--shard", default="0/1", help="K/N: this process takes every N-th row from the K-th (fine-tunes after their source)")
    p.add_argument("--report", action="store_true", help="regenerate docs/routes/table.md and the figures from the record, then stop")
    p.add_argument("--smoke", action="store_true", help="a tiny version of every arm, recorded beside --out, in seconds")
    args = p.parse_args(argv)
    if args.report:
        print(report())
        return 0
    record, test_size = RECORD, None
    if args.smoke:
        CONFIGS = {d: ROOT / "configs" / "tiny.yaml" for d in CONFIGS}
        FT_IMAGES, record, test_size = 256, args.out / "results.csv", 64
    k, n = (int(x) for x in args.shard.split("/"))
    chosen = args.arms or list(ARMS)
    todo = [(a, s) for s in args.seeds for a in ("one", "multi") if a in chosen]  # sources first
    todo += [(a, s) for s in args.seeds for a in ARMS if a in chosen and a not in ("one", "multi")]
    for arm, seed in [t for i, t in enumerate(todo) if i % n == k]:
        with locked(record):
            if any((r["data"], r["arm"], r["seed"]) == (args.data, arm, seed) for r in load_results(record)):
                print(f"[{args.data} {arm} seed {seed}] in the record already")
                continue
        name = f"{args.data}-{arm}-seed{seed}"
        source = args.out / "runs" / f"{args.data}-one-seed{seed}" if arm.startswith("ft") else None
        if source is not None and not source.is_dir():
            train_or_reuse(source, arm_args(args.data, "one", seed, args.out), source.name)
        while source is not None and not finished(source):
            print(f"[{name}] waiting for its source {source} to finish training", flush=True)
            time.sleep(30)
        run = train_or_reuse(args.out / "runs" / name, arm_args(args.data, arm, seed, args.out), name)
        rows = measure(run, args.data, arm, seed, source, test_size)
        with locked(record):
            save_results([r for r in load_results(record) if (r["data"], r["arm"], r["seed"]) != (args.data, arm, seed)] + rows, record)
    if args.smoke:
        print(table(load_results(record), args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
