#!/usr/bin/env python
"""Time to accuracy on 2 CPU cores, one lever at a time (issue 106's ablation; the record docs/time_to_accuracy/results.csv).

Each suite starts from the recipe a user has (the main job, the 15- and 60-minute Fashion-MNIST recipes) and adds one
lever per row: a schedule of training sizes (small first, the sizes the model is used at last), bf16 autocast, and
what else a row names. Every row is trained with three seeds, one run at a time with both cores and nothing else
running, and measured in absolute top-1 on the full test set at the sizes the suite is judged at (the main job: 32 px
and the transfer to 48 and 64; Fashion-MNIST: 28 px, with test-time augmentation as its own column).

    nice python -m benchmarks.time_to_accuracy --suite main                 # every row of a suite, 3 seeds
    nice python -m benchmarks.time_to_accuracy --suite main --rows schedule --seeds 0 1 2
    python -m benchmarks.time_to_accuracy --report                          # docs/time_to_accuracy/table.md, from the record
    python -m benchmarks.time_to_accuracy --smoke                           # seconds: the script still runs

Runs go to OUT/runs (default /tmp/time_to_accuracy), outside the repository: a finished run is reused, an interrupted
one resumed. A row of the record is (suite, row, seed, size): the run's training seconds (every epoch's steps and its
evaluation, across resumes), its epochs, the CPU, the autocast it trained with, and top-1 (with TTA where the recipe
has it).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from benchmarks.studykit import TrainSpec, mean_sd, train_or_reuse, training_time
from benchmarks.timing import cpu_name
from vitpe.checkpoint import checkpoint_config, load_checkpoint, model_from_checkpoint
from vitpe.evaluation import dataset_of, evaluate_at
from vitpe.runs import safe_name, write_csv

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "time_to_accuracy" / "results.csv"
CONFIGS = ROOT / "configs"
# The main job's sizes, small first: 40% of the epochs at 16-24 px, 35% at 16-40, the last quarter at the main job's
# own 16-48 (the sizes it must keep its accuracy at). Its steps cost about two thirds of the main job's (tokens ~ side^2).
MAIN_SCHEDULE = ("train.resolution_range=null", "train.resolution_schedule=[[0, 16, 24], [0.4, 16, 40], [0.75, 16, 48]]",
                 "train.amp=none")  # as the main job's amp=auto chose on every seed: one lever at a time
FMNIST_SCHEDULE = "train.resolution_schedule=[[0, 16, 20], [0.5, 24], [0.85, 28]]"
# FixRes's finish as a user runs it (train.py --init RUN): one epoch at the size the model is used at, from a finished
# run, at a fine-tune's lower peak lr.
FINISH_AT_32 = ("train.epochs=1", "train.resolution_range=null", "train.resolutions=[32]", "train.lr=0.0005", "train.warmup_epochs=0.1",
                "train.amp=none")
# Part 3's parity on a 192-wide model (bf16 must not cost accuracy wherever amp=auto may choose it): the 15-minute
# Fashion-MNIST recipe twice as wide
# (heads of 32 as in the recipe), a fixed 2 epochs (a third of them warm-up) so that both precisions take the same steps.
WIDE = (str(CONFIGS / "fashion_mnist_cpu.yaml"), ("model.embed_dim=192", "model.num_heads=6", "train.budget_min=null", "train.epochs=2",
                                                  "train.warmup_epochs=0.6"))


class Row(NamedTuple):
    lever: str  # what the row adds, as the table says it
    spec: TrainSpec
    after: Optional[str] = None  # a row of the same suite this one continues (train.py --init that row's run, same seed)


# suite -> (rows: name -> Row, the sizes it is judged at, its target)
SUITES: Dict[str, Tuple[Dict[str, Row], Tuple[int, ...], str]] = {
    "main": ({
        "main job": Row("the main job as shipped (configs/shapes.yaml: 8 epochs, a size per batch in 16-48 px)", TrainSpec(str(CONFIGS / "shapes.yaml"))),
        "schedule": Row("+ sizes that grow: 16-24 px, then 16-40, then 16-48 (fp32, as amp=auto chose for the main job)",
                     TrainSpec(str(CONFIGS / "shapes.yaml"), MAIN_SCHEDULE)),
        "6 epochs": Row("the main job cut to 6 epochs: about the schedule's time, at the main job's sizes (equal time)",
                     TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.epochs=6", "train.amp=none"))),
        "6 epochs + finish": Row("the 6-epoch run and a finish: one epoch at 32 px only, fine-tuned from it (train.py --init; lr 5e-4)",
                                 TrainSpec(str(CONFIGS / "shapes.yaml"), FINISH_AT_32), after="6 epochs"),
        "5 epochs, batch 64": Row("the main job at batch 64 (twice the optimizer steps an epoch) for 5 epochs instead of 8 (fp32)",
                                  TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.epochs=5", "train.batch_size=64", "train.amp=none"))),
        "5 epochs, batch 64 + finish": Row("that run and the finish above", TrainSpec(str(CONFIGS / "shapes.yaml"), FINISH_AT_32),
                                           after="5 epochs, batch 64"),
        "16-36 px": Row("the main job's 8 epochs without its costliest sizes: a size per batch in 16-36 px (fp32)",
                        TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.resolution_range=[16, 36]", "train.amp=none"))),
        "16-32 px": Row("the same in 16-32 px (fp32)", TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.resolution_range=[16, 32]", "train.amp=none"))),
        "bf16": Row("the main job with bf16 autocast forced (amp=auto measures fp32 faster at this width)",
                    TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.amp=bf16",))),
    }, (32, 48, 64), "the main job's top-1 at 32 px and its transfer to 48 and 64 (within 0.5 points) in at most 4 minutes"),
    "fmnist15": ({
        "recipe": Row("the 15-minute recipe as shipped (configs/fashion_mnist_cpu.yaml: 0.30M parameters, train.budget_min=15)",
                   TrainSpec(str(CONFIGS / "fashion_mnist_cpu.yaml"))),
        "schedule": Row("+ sizes that grow: 16-20 px, then 24, the last 15% at 28 (the budget counts each at its cost)",
                     TrainSpec(str(CONFIGS / "fashion_mnist_cpu.yaml"), (FMNIST_SCHEDULE,))),
    }, (28,), "Fashion-MNIST top-1 at 28 px in 15 minutes of wall time under 1M parameters (target 92.5%)"),
    "fmnist60": ({
        "recipe": Row("the 60-minute recipe as shipped (configs/fashion_mnist_cpu_60.yaml: 0.80M parameters, train.budget_min=60)",
                   TrainSpec(str(CONFIGS / "fashion_mnist_cpu_60.yaml"))),
        "schedule": Row("+ sizes that grow: 16-20 px, then 24, the last 15% at 28", TrainSpec(str(CONFIGS / "fashion_mnist_cpu_60.yaml"), (FMNIST_SCHEDULE,))),
    }, (28,), "Fashion-MNIST top-1 at 28 px in 60 minutes of wall time under 1M parameters (target 93.5%)"),
    "width192": ({
        "fp32": Row("the 15-minute Fashion-MNIST recipe 192 wide (1.20M parameters), 2 epochs, fp32 (amp=none)",
                    TrainSpec(WIDE[0], WIDE[1] + ("train.amp=none",))),
        "bf16": Row("the same run with bf16 autocast (amp=bf16): the same epochs and steps", TrainSpec(WIDE[0], WIDE[1] + ("train.amp=bf16",))),
    }, (28,), "bf16 autocast against fp32 at equal epochs on a 192-wide model: top-1 within the seeds' spread"),
}
FIELDS = ("suite", "row", "seed", "cpu", "amp", "epochs", "train_time_s", "size", "n", "top1", "top1_tta")


def run_spec(suite: str, row: str, seed: int) -> TrainSpec:
    return SUITES[suite][0][row].spec.plus(f"train.seed={seed}")


def run_dir(out: Path, suite: str, row: str, seed: int) -> Path:
    return out / "runs" / safe_name(f"{suite}-{row}-seed{seed}")


def lineage(run: Path) -> Tuple[int, float]:
    """Epochs and training seconds behind ``run``, counting the runs it was fine-tuned from (``init.source``)."""
    state = load_checkpoint(run)
    epochs, seconds = len(state["metrics"]), training_time(state["metrics"])
    source = checkpoint_config(state).init.source
    if source is not None and Path(source).is_dir():
        more_epochs, more_seconds = lineage(Path(source))
        epochs, seconds = epochs + more_epochs, seconds + more_seconds
    return epochs, seconds


def measure(run: Path, suite: str, row: str, seed: int, test_size: Optional[int]) -> List[Dict]:
    """The record's rows of one run: top-1 at each of its suite's sizes (TTA where the run's recipe measured it); a
    finish counts the epochs and time of the run it started from."""
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    ds = dataset_of(cfg, test_size=test_size)
    metrics = state["metrics"]
    tta = next((v for k, v in metrics[-1].items() if k.startswith("test_top1_tta_")), None)
    epochs, seconds = lineage(run)
    base = {"suite": suite, "row": row, "seed": seed, "cpu": cpu_name(), "amp": state.get("amp", "none"), "epochs": epochs,
            "train_time_s": round(seconds, 1)}
    plan = [("interpolate", "coords", (s, s)) for s in SUITES[suite][1]]
    out = []
    for r in evaluate_at(model, ds, plan, torch.device("cpu"), desc=f"{suite} {row} s{seed}"):
        tta_here = round(tta, 5) if tta is not None and r["height"] == cfg.model.img_size else None
        out.append({**base, "size": r["height"], "n": r["n"], "top1": round(r["top1"], 5), "top1_tta": tta_here})
        print(f"[{suite} {row} seed {seed}] {r['height']} px: top-1 {100 * r['top1']:.2f}% ({base['train_time_s'] / 60:.2f} min)", flush=True)
    return out


# ---- the record ----------------------------------------------------------------------------------------------------
def load_results(path: Path = RECORD) -> List[Dict]:
    if not path.is_file():
        return []
    ints, floats = {"seed", "epochs", "size", "n"}, {"train_time_s", "top1", "top1_tta"}
    with open(path, newline="") as f:
        return [{k: (int(v) if k in ints else float(v) if k in floats else v) if v != "" else None for k, v in r.items()}
                for r in csv.DictReader(f)]


def save_results(rows: List[Dict], path: Path = RECORD) -> None:
    order = {s: list(rows_) for s, (rows_, _, _) in SUITES.items()}
    rows = sorted(rows, key=lambda r: (list(SUITES).index(r["suite"]), order[r["suite"]].index(r["row"]), r["seed"], r["size"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_csv([{k: r[k] for k in FIELDS} for r in rows], path)


# ---- the report ----------------------------------------------------------------------------------------------------
def table(rows: List[Dict], suite: str) -> str:
    """A line per row of ``suite``: its lever, seeds, training minutes and top-1 (%) at each size, mean ± sd."""
    lever_rows, sizes, target = SUITES[suite]
    mine = [r for r in rows if r["suite"] == suite]
    tta = any(r["top1_tta"] is not None for r in mine)
    lines = [f"**{suite}**: {target}.", "",
             "| row | lever | seeds | training min | " + " | ".join(f"top-1 at {s} px" for s in sizes) + (" | with TTA |" if tta else " |"),
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in sizes) + (" | --- |" if tta else " |")]
    for row, (lever, *_) in lever_rows.items():
        runs = {r["seed"]: r for r in mine if r["row"] == row}
        if not runs:
            continue
        cells = [mean_sd([100 * r["top1"] for r in mine if r["row"] == row and r["size"] == s]) for s in sizes]
        with_tta = [100 * r["top1_tta"] for r in mine if r["row"] == row and r["top1_tta"] is not None]
        lines.append(f"| {row} | {lever} | {len(runs)} | {mean_sd([r['train_time_s'] / 60 for r in runs.values()])} | "
                     + " | ".join(cells) + (f" | {mean_sd(with_tta)} |" if tta else " |"))
    cpus = sorted({r["cpu"] for r in mine})
    lines += ["", f"Measured on {', '.join(cpus)}, 2 cores, one run at a time; autocast: "
              + "; ".join(f"{row} {'/'.join(sorted({r['amp'] for r in mine if r['row'] == row}))}" for row in lever_rows if any(r['row'] == row for r in mine))
              + "."]
    return "\n".join(lines)


def report(rows: List[Dict], out: Path) -> Path:
    text = ["# Time to accuracy: the record's table (python -m benchmarks.time_to_accuracy --report)", ""]
    for suite in SUITES:
        if any(r["suite"] == suite for r in rows):
            text += [table(rows, suite), ""]
    path = out / "table.md"
    path.write_text("\n".join(text).rstrip() + "\n")
    return path


def train_row(out: Path, suite: str, row: str, seed: int, smoke: bool = False) -> Path:
    """Train (or reuse) one seed of a row into OUT/runs; a row that continues another trains that one first."""
    spec, after = run_spec(suite, row, seed), SUITES[suite][0][row].after
    if after is not None:
        spec = spec.plus(f"init.source={train_row(out, suite, after, seed, smoke)}")
    if smoke:  # the tiny config, two epochs (a finish one, at 16 px), each row's other levers
        keep = tuple(o for o in spec.overrides if not o.startswith(("model.", "train.resolution", "train.epochs", "train.budget")))
        sizes = ("train.resolution_schedule=[[0, 8, 12], [0.5, 16]]",) if row == "schedule" else ("train.resolutions=[16]",) if after else ()
        spec = TrainSpec(str(CONFIGS / "tiny.yaml"), keep).plus(f"train.epochs={1 if after else 2}", *sizes)
    run = run_dir(out, suite, row, seed)
    return train_or_reuse(run, spec, run.name)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=list(SUITES), default="main")
    p.add_argument("--rows", nargs="+", help="rows of the suite (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("/tmp/time_to_accuracy"), help="where the runs go (outside the repository)")
    p.add_argument("--report", action="store_true", help="only write docs/time_to_accuracy/table.md from the record")
    p.add_argument("--smoke", action="store_true", help="tiny runs into OUT, the record in OUT: seconds")
    args = p.parse_args(argv)
    if args.report:
        print(f"wrote {report(load_results(), RECORD.parent)}")
        return 0
    rows_of = SUITES[args.suite][0]
    unknown = [r for r in args.rows or [] if r not in rows_of]
    if unknown:
        p.error(f"no row {unknown[0]!r} in suite {args.suite}; its rows: {', '.join(rows_of)}")
    record, test_size = (args.out / "results.csv", 64) if args.smoke else (RECORD, None)
    rows = load_results(record)
    for row in args.rows or list(rows_of):
        for seed in args.seeds:
            if any((r["suite"], r["row"], r["seed"]) == (args.suite, row, seed) for r in rows):
                print(f"[{args.suite} {row} seed {seed}] in the record already")
                continue
            run = train_row(args.out, args.suite, row, seed, args.smoke)
            rows = [r for r in rows if (r["suite"], r["row"], r["seed"]) != (args.suite, row, seed)] + measure(run, args.suite, row, seed, test_size)
            save_results(rows, record)
    print(report(rows, record.parent) if args.smoke else f"record: {record}; the table: python -m benchmarks.time_to_accuracy --report")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
