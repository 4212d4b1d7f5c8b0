#!/usr/bin/env python
"""Resolution transfer the way the field gets it: models trained at one size with the field's recipe (content scale
augmentation and coordinate augmentation) against the plain recipe, evaluated from 0.5x to 4x on every coordinate
mode that applies, FlexiViT's patch route and the baseline every user has, resizing the image back (docs/field_transfer.md).

    python -m benchmarks.field_transfer --data gratings --seeds 0 1 2                # every row; resumes where it stopped
    python -m benchmarks.field_transfer --data gratings --families sincos2d --recipes field --seeds 0
    nice python -m benchmarks.field_transfer --shard 0/2 & nice python -m benchmarks.field_transfer --shard 1/2 &
    python -m benchmarks.field_transfer --report                                      # tables and the figure from the record
    python -m benchmarks.field_transfer --smoke                                       # seconds: the script still runs

A row is (data, family, recipe, seed). ``plain`` trains with the dataset's recipe (configs/study_gratings.yaml,
configs/study_fashion_mnist.yaml); ``field`` adds RandomResizedCrop (``data.crop_scale`` FIELD_CROP) and DINOv3's
coordinate augmentation drawn per batch (``model.coord_aug`` FIELD_COORDS; not for families that read no
coordinates). Runs go to OUT/runs/DATA-FAMILY-RECIPE-seedS-eE (git-ignored): a finished run is reused, an interrupted
one resumed; a run still moving over its last fifth (studykit.convergence) is trained again with twice the epochs, up
to DOUBLINGS[data] times. Each measured row is merged into OUT/results.csv, the study's record (eval.py's columns plus
recipe, seed and the run's convergence), under a lock, so processes sharing OUT (``--shard K/N``) keep each other's.
Every size is evaluated on the full test set.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import vitpe
from benchmarks.studykit import TrainSpec, convergence, train_or_reuse
from vitpe.checkpoint import checkpoint_config, load_checkpoint, model_from_checkpoint
from vitpe.coords import snap
from vitpe.evaluation import dataset_of, evaluate_at, patch_fits
from vitpe.runs import safe_name

try:
    import fcntl
except ImportError:  # Windows: one process per OUT
    fcntl = None

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("gratings", "fashion_mnist")
CONFIGS = {"gratings": ROOT / "configs" / "study_gratings.yaml", "fashion_mnist": ROOT / "configs" / "study_fashion_mnist.yaml"}
FAMILIES = ("none", "sincos2d", "learned", "rel_bias", "cpb", "rope_axial", "rope_mixed", "fire", "lookhere", "alibi2d", "pape")
RECIPES = ("plain", "crops", "field")
FIELD_CROP = "[0.25, 1.0]"  # RandomResizedCrop's area range at 32 px (DeiT's 0.08 leaves a few patches of a 28-px image)
FIELD_COORDS = "{shift: 1.0, rescale: 2.0, jitter: 1.25, per_image: false}"  # DINOv3's RoPE augmentation, a draw per batch
SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
SEEDS = (0, 1, 2)
DOUBLINGS = {"gratings": 0, "fashion_mnist": 0}  # each row's budget: gratings 16 epochs, Fashion-MNIST 8 (the earlier study's)
PE_OPTIONS = {"pape": ["model.pos_embed_kwargs.parabolas=8"]}  # 3 x 8 + 2 more features a head at head_dim 32: the CPU's budget
FIELDS = ("data", "pos_embed", "recipe", "seed", "epochs", "converged", "last_fifth_gain_points", "train_time_s", "train_size",
          "route", "coord_mode", "scale", "resolution", "height", "width", "tokens_per_image", "n", "top1", "loss")


def run_args(data: str, family: str, recipe: str, seed: int, epochs: int, config: Optional[str], extra: List[str]) -> TrainSpec:
    """The run of a row."""
    sets = [f"train.seed={seed}", f"train.epochs={epochs}", *PE_OPTIONS.get(family, []), *extra]
    if recipe in ("crops", "field"):  # crops: the content scale augmentation alone, to part its effect from the coordinates'
        sets.append(f"data.crop_scale={FIELD_CROP}")
        if recipe == "field" and vitpe.pos_embed_info(family)["reads_coords"]:
            sets.append(f"model.coord_aug={FIELD_COORDS}")
    return TrainSpec(str(config or CONFIGS[data]), (f"model.pos_embed={family}", *sets))


def recipe_epochs(data: str, config: Optional[str], extra: List[str]) -> int:
    from vitpe.config import apply_overrides, load_config

    return apply_overrides(load_config(str(config or CONFIGS[data])), extra).train.epochs


def train_row(out: Path, data: str, family: str, recipe: str, seed: int, args) -> Path:
    """The row's run, trained until its last fifth is flat or its doublings are spent (the longest run is measured)."""
    epochs = recipe_epochs(data, args.config, args.set)
    most = epochs * 2 ** (DOUBLINGS[data] if args.max_doublings is None else args.max_doublings)
    while True:
        name = safe_name(f"{data}-{family}-{recipe}-seed{seed}-e{epochs}")
        run = train_or_reuse(out / "runs" / name, run_args(data, family, recipe, seed, epochs, args.config, args.set), name)
        if convergence(load_checkpoint(run)["metrics"])["converged"] or 2 * epochs > most:
            return run
        print(f"[{name}] still moving over its last fifth: training {2 * epochs} epochs")
        epochs *= 2


def plan_of(model, size: int, family: str, scales: Sequence[float] = SCALES) -> List[Tuple[str, str, Tuple[int, int]]]:
    """(coord_mode, route, size) for every evaluation of a row: each coordinate mode that applies at every scale (one mode
    for a family that reads no coordinates), the patch route where the trained grid fits, and the resize baseline."""
    modes = ["interpolate", "extrapolate"] if vitpe.pos_embed_info(family)["reads_coords"] else ["interpolate"]
    plan = []
    for s in scales:
        hw = (snap(s * size, model.patch_size),) * 2
        plan += [(m, "coords", hw) for m in modes]
        ref = model.ref_grid[0]
        patch_hw = (snap(s * size, ref),) * 2
        if patch_fits(model, *patch_hw):
            plan.append(("interpolate", "patch", patch_hw))
        if s != 1.0:
            plan.append(("interpolate", "resize", hw))
    return plan


def evaluate_row(run: Path, data: str, family: str, recipe: str, seed: int, test_size: Optional[int],
                 scales: Sequence[float] = SCALES) -> List[Dict]:
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    size = cfg.model.img_size
    ds = dataset_of(cfg, test_size=test_size)
    verdict = convergence(state["metrics"])
    base = {"data": data, "pos_embed": family, "recipe": recipe, "seed": seed, "train_size": size,
            **{k: verdict[k] for k in ("epochs", "converged", "last_fifth_gain_points", "train_time_s")}}
    rows = []
    for r in evaluate_at(model, ds, plan_of(model, size, family, scales), torch.device("cpu"), desc=f"{data} {family} {recipe} s{seed}"):
        scale = round((r["height"] * r["width"]) ** 0.5 / size, 4)
        rows.append({**base, **{k: r[k] for k in ("route", "coord_mode", "resolution", "height", "width", "tokens_per_image", "n", "top1")},
                     "loss": round(r["loss"], 4), "scale": scale})
        print(f"[{data} {family} {recipe} seed {seed}] {r['route']:<7} {r['coord_mode']:<12} {r['resolution']:>4}: "
              f"top-1 {100 * r['top1']:.2f}", flush=True)
    return rows


# ---- the record ----------------------------------------------------------------------------------------------------
def key_of(row: Dict) -> Tuple[str, str, str, int]:
    return row["data"], row["pos_embed"], row["recipe"], int(row["seed"])


def load_results(out: Path) -> List[Dict]:
    path = out / "results.csv"
    if not path.is_file():
        return []
    numbers = {"seed", "epochs", "train_size", "height", "width", "tokens_per_image", "n"}
    floats = {"last_fifth_gain_points", "train_time_s", "scale", "top1", "loss"}
    with open(path, newline="") as f:
        return [{k: (int(v) if k in numbers else float(v) if k in floats else v == "True" if k == "converged" else v)
                 for k, v in r.items()} for r in csv.DictReader(f)]


def save_results(rows: List[Dict], out: Path) -> None:
    tmp = out / "results.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (*key_of(r), r["route"], r["coord_mode"], r["scale"])))
    tmp.replace(out / "results.csv")


@contextlib.contextmanager
def locked(out: Path):
    (out / "runs").mkdir(parents=True, exist_ok=True)
    with open(out / "runs" / ".record.lock", "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---- the report ----------------------------------------------------------------------------------------------------
def nominal(scale: float) -> float:
    """The planned scale a measured one was snapped from: sizes are whole patches, so Fashion-MNIST's 1.5x (42 px) is
    measured at 40 px (1.43x) on the coordinate and resize routes and at 42 on the patch route."""
    return min(SCALES, key=lambda s: abs(math.log(scale / s)))


def changes(rows: List[Dict], data: str, family: str, recipe: str, route: str, mode: str, scale: float) -> List[float]:
    """Per seed: top-1 at the planned ``scale`` on (route, mode) minus top-1 at 1x on the coordinate route, in points."""
    def at(r_route: str, r_mode: str, s: float) -> Dict[int, float]:
        return {r["seed"]: r["top1"] for r in rows if (r["data"], r["pos_embed"], r["recipe"], r["route"], r["coord_mode"]) ==
                (data, family, recipe, r_route, r_mode) and nominal(r["scale"]) == s}

    one, there = at("coords", "interpolate", 1.0), at(route, mode, scale)
    return [100 * (there[s] - one[s]) for s in there if s in one]


def cell(values: List[float], signed: bool = True) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return (f"{m:+.1f}" if signed else f"{m:.1f}") + ("" if math.isnan(sd) else f" ± {sd:.1f}")


def series_of(rows: List[Dict], data: str, family: Optional[str], recipe: str, route: str, mode: str) -> List[Tuple[float, float]]:
    """(scale, top-1 % averaged over seeds) of one family (or, for ``None``, every family) on one route and mode."""
    def on(r_route: str, r_mode: str) -> List[Dict]:
        return [r for r in rows if (r["data"], r["recipe"], r["route"], r["coord_mode"]) == (data, recipe, r_route, r_mode)
                and family in (None, r["pos_embed"])]

    at: Dict[float, List[float]] = {}
    for r in on(route, mode):
        at.setdefault(round(r["scale"], 2), []).append(100 * r["top1"])
    if route == "resize":  # the baseline at 1x is the model itself
        at.setdefault(1.0, [100 * r["top1"] for r in on("coords", "interpolate") if nominal(r["scale"]) == 1.0])
    return sorted((s, statistics.fmean(v)) for s, v in at.items() if v)


def plot(rows: List[Dict], data: str, out: Path) -> Optional[Path]:
    """DATA.png: top-1 against scale, a panel per recipe on the coordinate route (interpolate), every family that reads
    positions as a line, no PE (``none``) dashed black and the resize baseline (mean over families) thick grey."""
    from vitpe.viz import pyplot
    from vitpe.viz.plots import draw_series

    sub = [r for r in rows if r["data"] == data]
    recipes = [rc for rc in RECIPES if any(r["recipe"] == rc for r in sub)]
    if not recipes:
        return None
    plt = pyplot()
    families = [f for f in FAMILIES if f != "none" and any(r["pos_embed"] == f for r in sub)]
    colours = {f: f"C{i}" for i, f in enumerate(families)}
    size = sub[0]["train_size"]
    fig, axes = plt.subplots(1, len(recipes), figsize=(5.2 * len(recipes), 4.6), sharey=True, squeeze=False)
    for ax, recipe in zip(axes[0], recipes):
        seeds = len({r["seed"] for r in sub if r["recipe"] == recipe})
        draw_series(ax, {f: series_of(sub, data, f, recipe, "coords", "interpolate") for f in families}, keep=families, colours=colours)
        nope = series_of(sub, data, "none", recipe, "coords", "interpolate")
        if nope:
            ax.plot(*zip(*nope), color="black", ls="--", lw=1.2, label="none (no PE)")
        base = series_of(sub, data, None, recipe, "resize", "interpolate")
        if base:
            ax.plot(*zip(*base), color="0.55", lw=4, alpha=0.6, zorder=0, label="resize to 1x (all families)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(SCALES, [f"{s:g}x" for s in SCALES])
        ax.minorticks_off()
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.axhline(10.0, color="grey", lw=0.8, ls="--")  # both datasets have 10 classes
        ax.annotate("chance", (SCALES[-1], 10.0), xytext=(-2, 2), textcoords="offset points", fontsize=7, color="grey", ha="right")
        ax.set_title(f"{recipe} recipe, coordinate route (up to {seeds} seed{'s' if seeds > 1 else ''} a family)", fontsize=9)
        ax.set_xlabel(f"test size / training size ({size} px)")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("top-1 accuracy (%), mean over seeds")
    handles, names = axes[0][0].get_legend_handles_labels()  # one legend under the panels, off the lines
    fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=8, frameon=False)
    fig.suptitle(f"{data}: trained at {size} px, measured at other sizes", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = out / f"{data}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(rows: List[Dict], out: Path, figures: bool = False) -> None:
    """table.md from the record (and, with ``figures``, a DATA.png per dataset)."""
    lines = [f"Generated by `python -m benchmarks.field_transfer --report` from {len(rows)} measurements (results.csv). Top-1 % at "
             "the training size (mean ± sd over seeds), then the change from it in points: on the coordinate route in "
             "interpolate (I) and extrapolate (E) mode, FlexiViT's patch route (P) and the resize baseline (R: the image "
             "resized back to the training size).", ""]
    for data in DATASETS:
        sub = [r for r in rows if r["data"] == data]
        if not sub:
            continue
        def sizes(route: str) -> str:
            return ", ".join(str(px) for px in sorted({int(r["height"]) for r in sub if r["route"] == route}))

        lines += [f"## {data}", "", f"Trained at {sub[0]['train_size']} px. Sizes (px, whole patches): coordinate and resize routes "
                  f"{sizes('coords')}; patch route {sizes('patch')}.", "",
                  "| family | recipe | seeds | 1x top-1 | 1.5x I / E / R | 2x I / E / P / R | 4x I / P / R |",
                  "| --- | --- | ---: | ---: | --- | --- | --- |"]
        for family in FAMILIES:
            for recipe in RECIPES:
                one = [100 * r["top1"] for r in sub if (r["pos_embed"], r["recipe"], r["route"], r["coord_mode"]) ==
                       (family, recipe, "coords", "interpolate") and nominal(r["scale"]) == 1.0]
                if not one:
                    continue
                parts = []
                for s, routes in ((1.5, (("coords", "interpolate"), ("coords", "extrapolate"), ("resize", "interpolate"))),
                                  (2.0, (("coords", "interpolate"), ("coords", "extrapolate"), ("patch", "interpolate"),
                                         ("resize", "interpolate"))),
                                  (4.0, (("coords", "interpolate"), ("patch", "interpolate"), ("resize", "interpolate")))):
                    parts.append(" / ".join(cell(changes(sub, data, family, recipe, route, mode, s)) for route, mode in routes))
                lines.append(f"| {family} | {recipe} | {len(one)} | {cell(one, signed=False)} | " + " | ".join(parts) + " |")
        lines.append("")
        if figures:
            plot(rows, data, out)
    lines += ["## Cost", "", "Training time of each row's run (one process a core, two or three rows sharing a 2-core machine), from the "
              "record's train_time_s; evaluation is not in it.", "",
              "| data | rows | training minutes a row: fewest / median / most | training process-hours |", "| --- | ---: | --- | ---: |"]
    for data in DATASETS:
        runs = {key_of(r): r["train_time_s"] / 60 for r in rows if r["data"] == data}
        if runs:
            t = sorted(runs.values())
            lines.append(f"| {data} | {len(t)} | {t[0]:.1f} / {statistics.median(t):.1f} / {t[-1]:.1f} | {sum(t) / 60:.1f} |")
    every = [r["train_time_s"] / 60 for r in {key_of(r): r for r in rows}.values()]
    lines.append(f"| all | {len(every)} | | {sum(every) / 60:.1f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=vitpe.list_pos_embeds())
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--config", help="one config for every dataset instead of each one's")
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    p.add_argument("--max-doublings", type=int, help="retrain a run still moving at most this many times (default: DOUBLINGS)")
    p.add_argument("--test-size", type=int, help="test images per evaluation (default: the full test set)")
    p.add_argument("--scales", nargs="+", type=float, default=list(SCALES), choices=SCALES, help="the sizes to evaluate, as multiples of the "
                   "training size (default: every one of SCALES; a row's cost is mostly its largest). 1 is always measured")
    p.add_argument("--until", metavar="HH:MM", help="start no new row after this time of day (a session's end; rows are lost if cut)")
    p.add_argument("--shard", default="0/1", help="K/N: this process takes every N-th row from the K-th (processes sharing OUT)")
    p.add_argument("--out", default=str(ROOT / "docs" / "field_transfer"))
    p.add_argument("--report", action="store_true", help="only rewrite table.md and the figures (DATA.png) from OUT/results.csv")
    p.add_argument("--smoke", action="store_true", help="tiny config, two families, one seed: seconds")
    args = p.parse_args(argv)
    k, _, n = args.shard.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard}")
    if args.until and not (len(args.until) == 5 and args.until[2] == ":" and args.until.replace(":", "").isdigit()):
        p.error(f"--until must be a time of day HH:MM, e.g. 16:30, got {args.until}")
    if args.smoke:
        args.data, args.config, args.seeds, args.test_size, args.max_doublings = ["gratings"], str(ROOT / "configs" / "tiny.yaml"), [0], 32, 0
        args.families = args.families if args.families != list(FAMILIES) else ["sincos2d", "pape"]
        args.set = [*args.set, "data.name=gratings", "train.epochs=1"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report(load_results(out), out, figures=True)
        print(f"report: {out / 'table.md'} and a figure per dataset")
        return 0
    todo = [(d, f, r, s) for d in args.data for s in args.seeds for f in args.families for r in args.recipes]
    mine = todo[int(k)::int(n)]
    started = time.time()
    for data, family, recipe, seed in mine:
        if any(key_of(r) == (data, family, recipe, seed) for r in load_results(out)):
            print(f"[{data} {family} {recipe} seed {seed}] measured: kept")
            continue
        if args.until and time.strftime("%H:%M") >= args.until:
            print(f"it is past {args.until}: no new row started ({(time.time() - started) / 60:.1f} min)")
            break
        run = train_row(out, data, family, recipe, seed, args)
        new = evaluate_row(run, data, family, recipe, seed, args.test_size, sorted({1.0, *args.scales}))
        with locked(out):
            rows = [r for r in load_results(out) if key_of(r) != (data, family, recipe, seed)] + new
            save_results(rows, out)
            report(rows, out)
        print(f"[{data} {family} {recipe} seed {seed}] measured ({(time.time() - started) / 60:.1f} min so far)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
