#!/usr/bin/env python
"""The resolution-transfer study: every PE family, also trained with per-image coordinate augmentation and with
multi-resolution training, several seeds, each model trained until its test accuracy stops moving, then measured
from 0.5x to 4x its training size and at two aspect ratios, on both coordinate modes, FlexiViT's patch-resize
route and the RoPE extrapolation controls, with each layer's attention distance and entropy beside the accuracy.

    python -m benchmarks.resolution_transfer --data shapes --seeds 0 1 2          # every row of one dataset
    python -m benchmarks.resolution_transfer --data shapes --rows rope_axial rope_axial:multires --seeds 0
    python -m benchmarks.resolution_transfer --report                             # tables and plots from the record
    python -m benchmarks.resolution_transfer --smoke                              # seconds: checks the script still runs
    python -m benchmarks.resolution_transfer --jobs 2 --data shapes --seeds 1 2   # two runs at a time, a core each
    python -m benchmarks.resolution_transfer --park --park-dir /shared/parked     # unfinished (or unevaluated) runs, for the next machine

A row is a family name, or ``FAMILY:aug`` (``model.coord_aug`` = AUG below, a draw per image), ``FAMILY:augbatch`` (the
same, one draw per batch: the default for PER_BATCH_ONLY, whose draw per image costs 9-35 times their training) or
``FAMILY:multires`` (``train.resolution_range`` = half to twice the training size). The recipe of every row of a dataset is one config,
``configs/study_DATA.yaml``. Runs go to OUT/runs/DATA-ROW-seedS-eEPOCHS: a finished run is reused and an interrupted
one resumed (one trained with another config than asked for is refused, never reused), and each run's rows are
merged into OUT/results.csv (and the report rewritten) as soon as it is measured, so the study can be stopped and
restarted at any point, across sessions. The runs are git-ignored; OUT/runs.jsonl, committed, records each run's
config and convergence, so that on another machine a seed already measured with this recipe is not trained again.
A run longer than a machine is kept: stop the study (it saves at a step boundary), ``--park`` copies every unfinished
run (and every finished one not yet evaluated) to PARK_DIR, a folder outside the repository that the next machine can
read (checkpoints never go into git), and the study there, given the same --park-dir, goes on from there (removing the
copy once it ends).

Convergence: a run has converged when its test top-1 rose by less than CONVERGED_POINTS over the last fifth of its
epochs. A run that has not is trained again from scratch with twice the epochs, up to --max-epochs (by default
DOUBLINGS per dataset: shapes doubles once, 24 -> 48; Fashion-MNIST trains its recipe's 8, never doubled), and the longest run
is the one measured; the report marks rows that still had not converged.
A row's next seed starts with the epochs its other seeds needed, a variant row's first with its plain family's
(see ``first_epochs``).
Several study processes may share one OUT: each claims a (data, row, seed) before it works on it and skips one another
process holds, and the shared files are merged under a lock. ``--jobs N`` starts N of them, with the cores split
between them (docs/benchmarks.md, CPU levers: on 2 cores a small ViT trains faster as two single-threaded processes).
Sizes: each scale x training size rounded to a multiple of the patch size (coordinate routes) or of the token grid
(patch route); aspect ratios at the training area.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import vitpe
from benchmarks.studykit import CONVERGED_POINTS, TrainSpec, convergence, park_run, train_or_reuse, training_time, unpark_run  # noqa: F401
from benchmarks.timing import usable_cores
from vitpe.checkpoint import CHECKPOINT_NAME, checkpoint_config, load_checkpoint, model_from_checkpoint
from vitpe.config import apply_overrides, load_config
from vitpe.coords import snap
from vitpe.evaluation import DEFAULT_ASPECTS, dataset_of, evaluate_at
from vitpe.runs import RunError, config_changes, safe_name, write_csv
from vitpe.training import resolve_config

try:
    import fcntl  # file locks for study processes sharing one OUT; POSIX only
except ImportError:  # Windows: one study process per OUT (--jobs refuses more)
    fcntl = None

ROOT = Path(__file__).resolve().parents[1]

SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
DATASETS = ("shapes", "fashion_mnist")
CONFIGS = {data: ROOT / "configs" / f"study_{data}.yaml" for data in DATASETS}
AUG = "{shift: 1.0, rescale: 2.0, jitter: 1.25}"  # one patch of shift, half to twice the scale, 25% aspect (DINOv3-like)
# A row's model.coord_aug by variant: ``:aug`` draws per image (CAPE), ``:augbatch`` the same distribution once per
# batch (as DINOv3's RoPE augmentation does), so the grid stays shared by the batch.
COORD_AUG = {"aug": AUG, "augbatch": AUG.replace("}", ", per_image: false}")}
VARIANTS = ("", *COORD_AUG, "multires")
# What the families declare (vitpe.pos_embed_info): those that read no coordinates get one coordinate mode and no
# coordinate augmentation; those that declare a cost of coordinates per image (matrix exponentials per image: liere at
# 0.03 of its own speed, ~15 h a seed; comrope at 0.11) draw their augmentation per batch, and rope_axial's row drawn per
# batch is the control that says what drawing per batch changes.
NO_COORDS = tuple(pe for pe in vitpe.list_pos_embeds() if not vitpe.pos_embed_info(pe)["reads_coords"])
PER_BATCH_ONLY = tuple(pe for pe in vitpe.list_pos_embeds() if vitpe.pos_embed_info(pe)["per_image_cost"])
PER_BATCH_CONTROL = "rope_axial"
ROPE_CONTROLS = ("ntk", "yarn")
SEEDS = (0, 1, 2)  # the seeds every row is measured with (the "at least 3"), unless --seeds says otherwise
# How many times a run still moving is trained again with twice its recipe's epochs (--max-epochs overrides the cap
# this gives). shapes: once, 24 -> 48, which every shapes row measured converged within. Fashion-MNIST: never, for the
# measured reason its recipe states (configs/study_fashion_mnist.yaml; docs/resolution_transfer.md, Protocol).
DOUBLINGS = {"shapes": 1, "fashion_mnist": 0}
TARGET_FLOOR = {"shapes": 0.95, "fashion_mnist": 0.90}  # the targets hold from this top-1 at 1x
TARGET_LOSS = {"shapes": {"2x": 0.5, "4x": 2.0}, "fashion_mnist": {"2x": 0.5}}  # ... losing at most these points
# The literature's orderings this study checks: (better, worse, scale, source).
ORDERINGS = (
    ("cpb", "rel_bias", 2.0, "Swin-V2: log-spaced CPB transfers better than the interpolated Swin bias table"),
    ("rope_mixed", "learned", 2.0, "RoPE-ViT: RoPE-Mixed transfers better than learned APE"),
    ("rope_mixed", "rope_axial", 2.0, "RoPE-ViT: RoPE-Mixed transfers better than axial RoPE"),
    ("fire", "rope_axial", 4.0, "FIRE: better than RoPE far from the training size"),
    ("lookhere", "rope_axial", 4.0, "LookHere: better than RoPE far from the training size"),
    # Coordinate augmentation is these papers' recipe for resolution robustness; here it is drawn per image.
    ("sincos2d:aug", "sincos2d", 2.0, "CAPE: sin-cos APE trained on shifted and rescaled coordinates transfers better"),
    ("rope_axial:aug", "rope_axial", 2.0, "DINOv3: RoPE trained on shifted, jittered and rescaled coordinates transfers better"),
    # Not a paper's claim: whether the per-batch draw of the PER_BATCH_ONLY rows stands in for a draw per image.
    (f"{PER_BATCH_CONTROL}:aug", f"{PER_BATCH_CONTROL}:augbatch", 2.0, "CAPE against DINOv3: a draw per image transfers better than one per batch"),
)


def in_grid(pe: str, variant: str) -> bool:
    """Whether the study's default grid has the row: every family plain and multi-size; with coordinate augmentation
    every family that reads coordinates, per image, or per batch where a draw per image is unaffordable (and the control)."""
    if variant in COORD_AUG and pe in NO_COORDS:
        return False
    if variant == "aug":
        return pe not in PER_BATCH_ONLY
    if variant == "augbatch":
        return pe in PER_BATCH_ONLY or pe == PER_BATCH_CONTROL
    return True


def all_rows() -> List[str]:
    return [f"{pe}:{v}" if v else pe for v in VARIANTS for pe in vitpe.list_pos_embeds() if in_grid(pe, v)]


def parse_row(row: str) -> Tuple[str, str]:
    """``FAMILY[:VARIANT]`` -> (family, variant). Any family that reads coordinates takes either augmentation, in the
    default grid or not (``liere:aug`` runs when asked for)."""
    pe, _, variant = row.partition(":")
    if pe not in vitpe.list_pos_embeds() or variant not in VARIANTS or (variant in COORD_AUG and pe in NO_COORDS):
        raise SystemExit(f"unknown study row {row!r}: a family of vitpe.list_pos_embeds(), optionally with "
                         f"{', '.join(':' + v for v in VARIANTS if v)} (no coordinate augmentation for {', '.join(NO_COORDS)}, "
                         "which read no coordinates)")
    return pe, variant


def study_config(data: str, args):
    """The recipe of every row of ``data``: its study config with the overrides given for every run."""
    return apply_overrides(load_config(str(args.config or CONFIGS[data])), args.set)


def train_args(data: str, row: str, seed: int, args) -> TrainSpec:
    """The run of a row (its epochs are the caller's)."""
    pe, variant = parse_row(row)
    config = args.config or CONFIGS[data]
    cfg = study_config(data, args)
    sets = [f"model.pos_embed={pe}", f"train.seed={seed}"]
    if variant in COORD_AUG:
        sets.append(f"model.coord_aug={COORD_AUG[variant]}")
    if variant == "multires":
        size, patch = cfg.model.img_size, cfg.model.patch_size
        sets.append(f"train.resolution_range=[{snap(size / 2, patch)}, {snap(2 * size, patch)}]")
    return TrainSpec(str(config), (*sets, *args.set))


def train_converged(data: str, row: str, seed: int, args, runs: Path, results: List[Dict]) -> Path:
    """Train the row with the recipe's epochs; while its test top-1 is still moving, train it again from scratch with
    twice the epochs (a new cosine schedule; the shorter run is kept), up to ``epoch_cap``. Every run trained is
    entered in OUT/runs.jsonl (``record_run``)."""
    recipe = study_config(data, args).train.epochs
    most = epoch_cap(data, recipe, args)
    epochs = first_epochs(runs, data, row, recipe, most, [*results, *load_trained(runs.parent)])
    while True:
        name = safe_name(f"{data}-{row}-seed{seed}-e{epochs}")  # the epochs in the name: a run is never taken for a longer one
        label, parked = f"{data} {row} seed {seed}, {epochs} epochs", park_dir(args, runs.parent) / name
        if unpark_run(parked, runs / name):
            print(f"[{label}] brought back from {parked} (parked by another machine): it goes on where it stopped")
        run = train_or_reuse(runs / name, train_args(data, row, seed, args).plus(f"train.epochs={epochs}"), label)
        if parked.exists():  # finished: the parked copy has done its work
            shutil.rmtree(parked)
            print(f"[{label}] finished: its parked copy {parked} is removed")
        state = load_checkpoint(run)
        verdict = convergence(state["metrics"])
        done = verdict["converged"] or 2 * epochs > most
        record_run(runs.parent, {"data": data, "row": row, "seed": seed, "run": run.name, **verdict,
                                 **({} if done else {"retrained_with": 2 * epochs}), "config": checkpoint_config(state).to_dict()})
        if done:
            return run
        print(f"[{data} {row} seed {seed}] still moving after {epochs} epochs: training {2 * epochs}")
        epochs *= 2


def park_dir(args, out: Path) -> Path:
    """Where --park puts runs for the next machine: --park-dir, else $VITPE_PARK_DIR, else ~/.cache/vitpe/parked/OUT's
    name. Never inside the repository: a parked run is a checkpoint, and checkpoints do not go into git."""
    where = getattr(args, "park_dir", None) or os.environ.get("VITPE_PARK_DIR") or Path.home() / ".cache" / "vitpe" / "parked" / out.name
    where = Path(where).resolve()
    if where.is_relative_to(ROOT):
        raise SystemExit(f"--park-dir {where} is inside the repository: park runs outside it (checkpoints never go into git)")
    return where


def park(out: Path, where: Path) -> int:
    """``--park``: every unfinished run in OUT/runs copied to ``where`` (``park_dir``), for the next machine to go on with:
    the study brings a parked run back when it reaches it (``train_converged``) and removes the copy once it finishes.
    A finished run that results.csv does not hold yet (stopped between its last epoch and its evaluation) is parked
    too, unless runs.jsonl says a longer run replaced it: the next machine then evaluates it instead of training it
    again."""
    # Finished runs with nothing left to do here: evaluated, or replaced by a longer run of the same seed.
    settled = {Path(r["run"]).name for r in load_results(out)} | {e["run"] for e in load_trained(out) if e.get("retrained_with")}
    parked = 0
    for run in sorted(p for p in (out / "runs").iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            if park_run(run, where / run.name, finished=run.name not in settled):
                parked += 1
                print(f"parked {run.name} ({(where / run.name / CHECKPOINT_NAME).stat().st_size / 1e6:.1f} MB)")
        except RunError as e:
            print(f"{e}: not parked")
    print(f"{parked} run{'s' * (parked != 1)} parked in {where} (unfinished or not yet evaluated)"
          + (": give the next machine this folder and the same --park-dir" if parked else ""))
    return 0


def epoch_cap(data: str, recipe: int, args) -> int:
    """The most epochs a run of ``data`` is trained with: --max-epochs where given, else its recipe's epochs
    (``recipe``, after ``--set``) doubled DOUBLINGS[data] times."""
    return args.max_epochs or recipe * 2 ** DOUBLINGS[data]


# ---- the record: three compact files that --report regenerates every table and figure from -----------------------------
# results.csv: one line per measurement (run x route x size); runs.jsonl: one line per trained run (its convergence,
# training time and config); attention.csv: each layer's attention distance and entropy where measured. A row of the
# study in memory (``evaluate_run``, ``load_results``) is a measurement joined with its run; the fields that follow from
# others (the family, the route, the scale) are not stored.
RUNS_RECORD = "runs.jsonl"
MEASUREMENT_FIELDS = ("data", "row", "seed", "epochs", "train_size", "chance", "label", "column", "height", "width",
                      "tokens_per_image", "n", "top1", "loss", "images_per_s")
RUN_FIELDS = ("run", "last_fifth_gain_points", "converged", "last_epoch_test_top1", "train_acc",
              "train_wall_s", "train_time_s")
ATTENTION_FIELDS = ("attn_distance_ref", "attn_entropy")  # per layer: distance in training-grid cells, entropy in nats
ROUNDING = {"loss": 4, "train_acc": 5, "images_per_s": 1}


def derived(measurement: Dict) -> Dict:
    """The fields of a study row that its label, column and size determine."""
    pe, variant = measurement["row"].partition(":")[::2]
    label, column, h, w = measurement["label"], measurement["column"], measurement["height"], measurement["width"]
    square = column_order(column)[0] == 0
    return {"pe": pe, "variant": variant or "plain", "route": "patch" if label == "patch" else "coords",
            "coord_mode": "extrapolate" if label.startswith("extrapolate") else "interpolate",
            "rope_scaling": label.partition("+")[2] or "none", "scale": float(column[:-1]) if square else 1.0,
            "resolution": str(h) if h == w else f"{h}x{w}"}


def _cell(value) -> str:
    return "" if value is None else str(value)


def _number(text: str):
    if text == "":
        return None
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def load_results(out: Path) -> List[Dict]:
    """The study's record so far (results.csv joined with runs.jsonl and attention.csv; empty before the first
    measurement), as the rows ``evaluate_run`` makes."""
    path = out / "results.csv"
    if not path.is_file():
        return []
    runs = {run_key(e): e for e in load_trained(out)}
    attention = {}
    if (out / "attention.csv").is_file():
        with open(out / "attention.csv", newline="") as f:
            for a in csv.DictReader(f):
                key = (a["data"], a["row"], int(a["seed"]), int(a["epochs"]), a["label"], a["column"])
                attention[key] = {k: [None if v == "nan" else float(v) for v in a[k].split()] for k in ATTENTION_FIELDS}
    rows = []
    with open(path, newline="") as f:
        for m in csv.DictReader(f):
            row = {k: (m[k] if k in ("data", "row", "label", "column") else _number(m[k])) for k in MEASUREMENT_FIELDS if k in m}
            run = runs.get(run_key(row), {})
            row.update({k: run[k] for k in RUN_FIELDS if k in run}, **derived(row))
            row.update(attention.get((*run_key(row), row["label"], row["column"]), {}))
            rows.append(row)
    return rows


def save_results(rows: List[Dict], out: Path) -> None:
    """Write the record of ``rows``: their measurements, their runs' fields merged into runs.jsonl (a run's config and
    ``retrained_with``, entered when it was trained, are kept) and their attention statistics."""
    runs = {run_key(e): e for e in load_trained(out)}
    for r in rows:
        fields = {k: rounded(k, r[k]) for k in RUN_FIELDS if k in r}
        if "run" in fields:
            fields["run"] = Path(fields["run"]).name
        runs[run_key(r)] = {**runs.get(run_key(r), {"data": r["data"], "row": r["row"], "seed": r["seed"], "epochs": r["epochs"]}),
                            **fields}
    write_trained(out, list(runs.values()))
    lines = [",".join(MEASUREMENT_FIELDS)] + [",".join(_cell(rounded(k, r.get(k))) for k in MEASUREMENT_FIELDS) for r in rows]
    write_atomic(out / "results.csv", "\n".join(lines) + "\n")
    layers = lambda values: " ".join("nan" if v is None else str(round(v, 4)) for v in values)  # noqa: E731
    keys = ("data", "row", "seed", "epochs", "label", "column")
    lines = [",".join(keys + ATTENTION_FIELDS)] + [",".join([*(str(r[k]) for k in keys), *(layers(r[k]) for k in ATTENTION_FIELDS)])
                                                   for r in rows if all(r.get(k) for k in ATTENTION_FIELDS)]
    write_atomic(out / "attention.csv", "\n".join(lines) + "\n")


def load_trained(out: Path) -> List[Dict]:
    """OUT/runs.jsonl: every run the study trained, one JSON object a line, with its config and convergence verdict. The
    runs themselves are git-ignored (hundreds of MB), so this is what another machine or a fresh clone knows of them."""
    path = out / RUNS_RECORD
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_key(entry: Dict) -> Tuple[str, str, int, int]:
    return entry["data"], entry["row"], entry["seed"], entry["epochs"]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")  # the record of hours of runs: never half-written
    tmp.write_text(text)
    tmp.replace(path)


def rounded(key: str, value):
    """A value as the record keeps it: a few fields rounded (``ROUNDING``), so that a value reads back the same."""
    return round(value, ROUNDING[key]) if key in ROUNDING and isinstance(value, float) and math.isfinite(value) else value


def write_trained(out: Path, entries: List[Dict]) -> None:
    entries = sorted(({k: rounded(k, v) for k, v in e.items()} for e in entries), key=run_key)
    write_atomic(out / RUNS_RECORD, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in entries))


def record_run(out: Path, entry: Dict) -> None:
    """Enter a trained run in OUT/runs.jsonl (replacing an older entry of the same data, row, seed and epochs)."""
    with study_lock(out):
        write_trained(out, [e for e in load_trained(out) if run_key(e) != run_key(entry)] + [entry])


@contextlib.contextmanager
def study_lock(out: Path):
    """Held while a study process reads, merges and rewrites OUT's shared files (runs.jsonl, results.csv, attention.csv and the
    report): several study processes may work on one OUT at once (``--jobs``), and each keeps what the others merged.
    An flock, so a process that dies lets go of it."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    with open(out / "runs" / ".study.lock", "a") as f:  # in runs/, which git ignores
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def claim(out: Path, data: str, row: str, seed: int):
    """Yields whether this process may study (data, row, seed): False while another study process holds it, so processes
    sharing one OUT (``--jobs``, or commands started by hand) split the work instead of training one run twice. An
    flock: a killed process's claim is gone with it, and its run is resumed by the next process that reaches it."""
    claims = out / "runs" / ".claims"  # git-ignored with the runs, out of their listing
    claims.mkdir(parents=True, exist_ok=True)
    with open(claims / f"{safe_name(f'{data}-{row}-seed{seed}')}.lock", "a") as f:
        try:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def measured_elsewhere(out: Path, results: List[Dict], data: str, row: str, seed: int, args) -> Optional[str]:
    """Why the study need not train (data, row, seed) again on this machine, or None: its measurements are in
    ``results`` and runs.jsonl says their run was trained with the config the study asks for now. Only where the run
    is not here (a fresh clone, another machine): a run that is here is checked and reused as usual. A recipe changed
    since (another config) means training again, and the new measurements replace the old."""
    if run_epochs(out / "runs", data, row, seed):
        return None
    epochs = {r["epochs"] for r in results if (r["data"], r["row"], r["seed"]) == (data, row, seed)}
    if len(epochs) != 1:  # not measured (or a mixed record): train
        return None
    entry = next((e for e in load_trained(out) if (e["data"], e["row"], e["seed"], e["epochs"]) == (data, row, seed, *epochs)), None)
    if entry is None or "config" not in entry:  # no config recorded: nothing says it is the recipe asked for
        return None
    spec = train_args(data, row, seed, args).plus(f"train.epochs={entry['epochs']}")
    wanted = resolve_config(spec.config, spec.overrides)
    changes = config_changes(entry["config"], wanted.to_dict())
    if changes:
        print(f"[{data} {row} seed {seed}] measured with another config than this study asks for ({'; '.join(changes)}): "
              "training it again")
        return None
    return f"measured before ({entry['epochs']} epochs; results.csv, runs.jsonl) and its run is not on this machine"


def first_epochs(runs: Path, data: str, row: str, recipe: int, most: int, results: Sequence[Dict] = ()) -> int:
    """The epochs a row's run starts with: the recipe's, or the most any of the row's seeds has been trained with,
    up to ``most``; a variant row none of whose seeds has been trained yet (``FAMILY:aug``, ``:multires``) starts with
    its plain family's. A longer run is trained from scratch, so a seed that starts where another seed needed to go ends
    with the run the doubling would reach, minus the shorter runs (hours of the grid); a seed that would have
    converged sooner only trains longer. The seeds' epochs come from their run directories and from the committed
    record (run directories are git-ignored): the measurements and runs.jsonl's entries (``record_run``) in
    ``results``, where ``retrained_with`` says where a run still moving sent its seed."""
    def tried(name: str) -> List[int]:
        return run_epochs(runs, data, name) + [r.get("retrained_with", r["epochs"]) for r in results if (r["data"], r["row"]) == (data, name)]

    # Every variant row measured before this rule needed its plain family's epochs (docs: Protocol, Convergence).
    epochs = tried(row) or tried(parse_row(row)[0])
    return max(recipe, min(most, max(epochs, default=recipe)))


def run_epochs(runs: Path, data: str, row: str, seed: Optional[int] = None) -> List[int]:
    """The epochs of the row's runs on this machine, of one seed or of every seed."""
    name = re.compile(re.escape(safe_name(f"{data}-{row}-seed")) + (r"\d+" if seed is None else str(seed)) + r"-e(\d+)")
    return [int(m.group(1)) for p in runs.iterdir() if (m := name.fullmatch(p.name))] if runs.is_dir() else []


CHECKPOINT_ID = ("epochs", "last_epoch_test_top1", "train_wall_s")


def measured_before(results: List[Dict], key: Tuple[str, str, int], metrics: List[Dict]) -> bool:
    """Whether ``results`` hold the measurements of this very checkpoint. Its epochs alone would not tell: a run trained
    again after the recipe changed (the old one moved away) has as many epochs, but not the same history."""
    now = convergence(metrics)
    ids = {tuple(r.get(k) for k in CHECKPOINT_ID) for r in results if (r["data"], r["row"], r["seed"]) == key}
    return ids == {tuple(now[k] for k in CHECKPOINT_ID)}


def sizes(size: int, patch: int, ref: int) -> List[Tuple[str, float, Tuple[int, int], Optional[Tuple[int, int]]]]:
    """(column, scale, coordinate-route size, patch-route size) for every column of the tables. The patch route keeps
    the trained square token grid, so it has no non-square sizes (None)."""
    out = [(f"{s:g}x", s, (snap(s * size, patch),) * 2, (snap(s * size, ref),) * 2) for s in SCALES]
    for a in DEFAULT_ASPECTS:
        hw = (snap(size * a**0.5, patch), snap(size / a**0.5, patch))
        out.append((f"{hw[0]}x{hw[1]}", 1.0, hw, None))
    return out


def evaluate_run(run: Path, data: str, row: str, seed: int, args) -> List[Dict]:
    pe, variant = parse_row(row)
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    size, patch, ref = cfg.model.img_size, model.patch_size, model.ref_grid[0]
    ds = dataset_of(cfg, test_size=args.eval_size)
    rotary = any(getattr(m, "rotary", False) for m in model.modules())
    base = {"data": data, "row": row, "pe": pe, "variant": variant or "plain", "seed": seed, "train_size": size,
            "chance": 1 / ds.num_classes, "run": str(run.relative_to(ROOT) if run.is_relative_to(ROOT) else run),
            **convergence(state["metrics"])}
    out = []
    columns = sizes(size, patch, ref)
    # (label, route, rope scaling); the rope controls only at sizes where a side passes the trained extent (below).
    plan = [("interpolate", "coords", None), ("patch", "patch", None)]
    if pe not in NO_COORDS:
        plan.insert(1, ("extrapolate", "coords", None))
    if rotary:
        plan += [(f"extrapolate+{s}", "coords", s) for s in ROPE_CONTROLS]
    for label, route, scaling in plan:
        mode = "extrapolate" if label.startswith("extrapolate") else "interpolate"
        if rotary:
            try:
                vitpe.set_rope_extrapolation(model, scaling or "none")
            except ValueError:  # liere and comrope learn matrices: only position interpolation applies to them
                continue
        todo = [c for c in columns if (scaling is None or max(c[2]) > size) and (route != "patch" or c[3] is not None)]
        entries = [(mode, route, c[3] if route == "patch" else c[2]) for c in todo]
        diag = args.diagnostics if route == "coords" and scaling is None else 0
        for col, r in zip(todo, evaluate_at(model, ds, entries, torch.device("cpu"), desc=f"{data} {row} s{seed} {label}",
                                           diagnostics=diag)):
            # one patch of the training grid, in pixels at this size: distances in it are comparable across sizes
            ref_patch_px = patch * math.sqrt(r["height"] * r["width"]) / size
            if "attn_distance" in r:
                r["attn_distance_ref"] = [None if d is None else round(d / ref_patch_px, 3) for d in r["attn_distance"]]
            out.append({**base, "label": label, "route": route, "coord_mode": mode, "rope_scaling": scaling or "none",
                        "column": col[0], "scale": col[1], "height": r["height"], "width": r["width"],
                        "resolution": r["resolution"], "top1": r["top1"], "loss": r["loss"], "n": r["n"],
                        "tokens_per_image": r["tokens_per_image"], "images_per_s": r["images_per_s"],
                        **{k: v for k, v in r.items() if k.startswith("attn_")}})
            print(f"[{data} {row} seed {seed}] {label:<18} {col[0]:>6} ({r['resolution']}): top-1 {100 * r['top1']:.2f}")
    return out


# ---- the report ------------------------------------------------------------------------------------------------------
def mean_sd(values: List[float]) -> Tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def cells(rows: List[Dict]) -> Dict[Tuple[str, str, str, str], List[Dict]]:
    """Rows grouped by (data, row, label, column): one entry per seed."""
    out: Dict[Tuple[str, str, str, str], List[Dict]] = {}
    for r in rows:
        out.setdefault((r["data"], r["row"], r["label"], r["column"]), []).append(r)
    return out


def column_order(column: str) -> Tuple[int, float, str]:
    """Square scales first, smallest first (``"0.5x"``), then the non-square sizes (``"24x44"``)."""
    try:
        return 0, float(column[:-1]), ""
    except ValueError:
        return 1, 0.0, column


def fmt(group: Optional[List[Dict]]) -> str:
    """Top-1 % of a cell: mean ± sd over seeds (the mean alone for one seed)."""
    if not group:
        return "-"
    m, sd = mean_sd([100 * g["top1"] for g in group])
    return f"{m:.1f}" if math.isnan(sd) else f"{m:.1f} ± {sd:.1f}"


def drops(group: Dict, data: str, row: str, label: str, column: str) -> List[float]:
    """(top-1 at ``column``) - (top-1 at 1x) of each seed, paired by seed, in points."""
    at, one = group.get((data, row, label, column)), group.get((data, row, label.partition("+")[0], "1x"))  # RoPE controls: vs extrapolate
    base = {r["seed"]: r["top1"] for r in one or []}
    return [100 * (r["top1"] - base[r["seed"]]) for r in at or [] if r["seed"] in base]


def drop(group: Dict, data: str, row: str, label: str, column: str) -> Optional[float]:
    """Mean over seeds of the change from 1x (``drops``), in points."""
    diffs = drops(group, data, row, label, column)
    return statistics.fmean(diffs) if diffs else None


def n_seeds(values: List[float]) -> str:
    return f"{len(values)} seed{'s' if len(values) > 1 else ''}"


def ordering_verdict(better: str, a: List[float], worse: str, b: List[float], moving: List[str]) -> str:
    """Whether the changes from 1x ``a`` (of row ``better``, one per seed) beat ``b``: 'confirmed' or 'contradicted'
    when the means differ by at least twice the standard error of their difference over seeds (a row with one seed
    borrows the other's spread), else 'not separated'. Models trained at one size differ far more between seeds in
    how they transfer than at 1x (rope_axial at 4x: -7.0 to -33.9 over three seeds), so one seed cannot rank them."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    verdict = "confirmed" if diff > 0 else "contradicted"
    spread = {row: statistics.stdev(v) for row, v in ((better, a), (worse, b)) if len(v) > 1}
    if not spread:
        verdict += " on one seed each (the spread between seeds is not known)"
    else:
        sd_a, sd_b = spread.get(better, spread.get(worse)), spread.get(worse, spread.get(better))
        se = math.sqrt(sd_a ** 2 / len(a) + sd_b ** 2 / len(b))
        borrowed = [row for row in (better, worse) if row not in spread]
        if abs(diff) < 2 * se:
            verdict = f"not separated (a difference of {abs(diff):.1f} against twice its standard error over seeds, {2 * se:.1f})"
        if borrowed:
            verdict += f" ({borrowed[0]}: one seed, its spread taken as the other row's)"
    if moving:  # an unfinished model ranks how fast it learns as much as how it transfers
        verdict += f"; provisional: {' and '.join(moving)} had not converged"
    return verdict


def points(change: Optional[float]) -> str:
    """A change in points for the tables: a 0.0 change is a number, a missing one is '-'."""
    return "-" if change is None else f"{change:+.1f}"


def best_rows(rows: List[Dict], data: str, floor: float) -> List[Tuple[float, str, str, float]]:
    """(loss at 2x, row, label, top-1 at 1x) on the coordinate routes, for rows at least ``floor`` at 1x, best first."""
    group = cells(rows)
    out = []
    for (d, row, label, column), g in group.items():
        if d != data or column != "1x" or label == "patch" or label.startswith("extrapolate+"):
            continue
        one = statistics.fmean(r["top1"] for r in g)
        two = drop(group, data, row, label, "2x")
        if one >= floor and two is not None:
            out.append((two, row, label, one))
    return sorted(out, reverse=True)


def target_cells(group: Dict, data: str, row: str, label: str = "interpolate") -> Dict[int, Tuple[float, Dict[str, Optional[float]], bool]]:
    """Per seed of ``row`` on ``label``'s route: (top-1 % at 1x, {target scale: change from 1x in points, None where not
    measured}, whether it meets the issue's target). A seed meets it when its top-1 at 1x is at least TARGET_FLOOR and
    it loses at most TARGET_LOSS points at each of the target's scales; a missing scale does not meet it."""
    one = {r["seed"]: r["top1"] for r in group.get((data, row, label, "1x"), [])}
    at = {column: {r["seed"]: r["top1"] for r in group.get((data, row, label, column), [])} for column in TARGET_LOSS[data]}
    out = {}
    for seed, top1 in sorted(one.items()):
        change = {c: (100 * (at[c][seed] - top1) if seed in at[c] else None) for c in TARGET_LOSS[data]}
        met = top1 >= TARGET_FLOOR[data] and all(change[c] is not None and change[c] >= -limit - 1e-9
                                                 for c, limit in TARGET_LOSS[data].items())
        out[seed] = (100 * top1, change, met)
    return out


def seeds_met(per_seed: Dict[int, Tuple[float, Dict[str, Optional[float]], bool]]) -> Tuple[int, int]:
    """(seeds that meet the target, seeds measured) of one row's ``target_cells``."""
    return sum(met for _, _, met in per_seed.values()), len(per_seed)


def target_seeds(group: Dict, data: str, row: str, label: str = "interpolate") -> Tuple[int, int]:
    """(seeds of ``row`` that meet the issue's target on ``label``'s route, seeds measured)."""
    return seeds_met(target_cells(group, data, row, label))


def train_seconds(entry: Dict) -> Optional[float]:
    """A run's training seconds from its record (a results.csv row or a runs.jsonl entry): ``train_time_s`` (a
    resumed run's pieces summed), else ``train_wall_s``; early entries have only one of them, a few neither. A tiny run
    can round to 0.0 seconds: that is a measurement, not a missing one."""
    for key in ("train_time_s", "train_wall_s"):
        if entry.get(key) is not None and not math.isnan(entry[key]):
            return entry[key]
    return None


def still_to_measure(rows: List[Dict], data: str) -> List[str]:
    """The report's to-do list for ``data``: every study row (``all_rows``) that lacks one of SEEDS, as
    ``row (needs seeds 1, 2)`` where some seed is measured (these first), else plain ``row`` (needs every seed)."""
    have: Dict[str, set] = {}
    for r in rows:
        if r["data"] == data:
            have.setdefault(r["row"], set()).add(r["seed"])
    missing = {row: [s for s in SEEDS if s not in have.get(row, set())] for row in all_rows()}
    return ([f"{row} (needs seed{'s' * (len(m) > 1)} {', '.join(map(str, m))})" for row, m in missing.items() if 0 < len(m) < len(SEEDS)]
            + [row for row, m in missing.items() if len(m) == len(SEEDS)])


def trained_table(trained: List[Dict]) -> List[str]:
    """OUT/trained.md: every run the study trained (the shorter run of a doubled row too), in the study's row order,
    with its convergence and training time; the wall-clock conditions (what ran beside) are in the study's doc."""
    order = {row: i for i, row in enumerate(all_rows())}
    lines = ["Generated by `python -m benchmarks.resolution_transfer --report` from runs.jsonl. Training minutes count "
             "only the training of each run (a resumed run's pieces summed; `-` where the record has none). They depend on "
             "what else ran on the machine meanwhile (two single-threaded study processes side by side take about 1.5x as "
             "long each as one run alone).", ""]
    timed = [t for t in map(train_seconds, trained) if t is not None]
    lines += ["| runs | with a time | process-hours of training, in all |", "| ---: | ---: | ---: |",
              f"| {len(trained)} | {len(timed)} | {sum(timed) / 3600:.1f} |", ""]
    for data in DATASETS:
        runs = sorted((e for e in trained if e["data"] == data), key=lambda e: (order.get(e["row"], len(order)), e["row"], e["seed"], e["epochs"]))
        if not runs:
            continue
        lines += [f"## {data}", "", "| row | seed | epochs | last fifth (points) | converged | train min | min / epoch | last epoch's test top-1 % |",
                  "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for e in runs:
            t = train_seconds(e)
            verdict = "yes" if e.get("converged") else f"no: retrained with {e['retrained_with']}" if e.get("retrained_with") else "no"
            gain = e.get("last_fifth_gain_points", math.nan)  # NaN for a run too short to have a last fifth
            lines.append(f"| {e['row']} | {e['seed']} | {e['epochs']} | {'-' if math.isnan(gain) else f'{gain:+.2f}'} | {verdict} | "
                         + (f"{t / 60:.1f} | {t / 60 / e['epochs']:.2f} |" if t is not None else "- | - |")
                         # on the run's whole test set, as its training printed it (the study's cells use the first --eval-size images)
                         + (f" {100 * e['last_epoch_test_top1']:.1f} |" if e.get("last_epoch_test_top1") is not None else " - |"))
        lines.append("")
    return lines


def report(rows: List[Dict], out: Path) -> None:
    save_results(rows, out)
    group = cells(rows)
    cell_rows: List[Dict] = []
    lines = [f"Generated by `python -m benchmarks.resolution_transfer --report` from {len(rows)} measurements. Cells: mean "
             f"± sd of top-1 % over seeds. `*` after a row: a seed that had not converged (test top-1 rose "
             f"{CONVERGED_POINTS} points or more over its last fifth of epochs). A cosine schedule flattens every run's "
             f"last fifth, so the training top-1 (last epoch, with augmentation and label smoothing) stands beside the test "
             f"top-1: a test top-1 close to it means underfitting, and a flat last fifth then says the schedule ended, not that "
             f"the model learned what it can.", ""]
    for data in DATASETS:
        sub = [r for r in rows if r["data"] == data]
        if not sub:
            continue
        columns = sorted({r["column"] for r in sub}, key=column_order)
        run_info = {}
        for r in sub:
            run_info.setdefault(r["row"], {})[r["seed"]] = r
        lines += [f"## {data} (trained at {sub[0]['train_size']} px)", "",
                  "| row | seeds | epochs | train min | converged | train top-1 | 1x top-1 |",
                  "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
        for row, seeds in run_info.items():
            conv = [s["converged"] for s in seeds.values()]
            fit = [100 * s["train_acc"] for s in seeds.values() if s.get("train_acc") is not None]
            # train_seconds' None (a record without a time) is left out, as in trained.md, not averaged into a crash.
            minutes = [t / 60 for t in map(train_seconds, seeds.values()) if t is not None]
            lines.append(f"| {row} | {len(seeds)} | {statistics.fmean(s['epochs'] for s in seeds.values()):.0f} | "
                         f"{f'{statistics.fmean(minutes):.1f}' if minutes else '-'} | {sum(conv)}/{len(conv)} | "
                         f"{f'{statistics.fmean(fit):.1f}' if fit else '-'} | "
                         f"{fmt(group.get((data, row, 'interpolate', '1x')))} |")
        todo = still_to_measure(rows, data)
        lines += ["", f"Still to measure on {data} ({len(todo)} of {len(all_rows())} rows): {', '.join(todo)}." if todo
                  else f"Every row of the study is measured on {data} with seeds {', '.join(map(str, SEEDS))}.", ""]
        # Every cell of every route (row x mode x size) is a record, not a page: cells.csv, one line a cell.
        for label in dict.fromkeys(r["label"] for r in sub):
            for row in run_info:
                for c in columns:
                    g = group.get((data, row, label, c))
                    if g:
                        top1 = [100 * r["top1"] for r in g]
                        attn = [r for r in g if label == "interpolate" and grid_entropy(r, group) is not None]
                        cell_rows.append({"data": data, "row": row, "route": label, "size": c, "seeds": len(top1),
                                          "converged_seeds": sum(bool(run_info[row][r["seed"]]["converged"]) for r in g),
                                          "top1_mean": round(statistics.fmean(top1), 2),
                                          "top1_sd": round(statistics.stdev(top1), 2) if len(top1) > 1 else "",
                                          # the last layer's attention, interpolate mode only: entropy in nats minus log(keys / keys at 1x), distance in cells
                                          "attn_entropy": round(statistics.fmean(grid_entropy(r, group) for r in attn), 3) if attn else "",
                                          "attn_distance": round(statistics.fmean(r["attn_distance_ref"][-1] for r in attn), 2) if attn else ""})
        lines += [f"Every cell of every route and size ({data}: {', '.join(dict.fromkeys(r['label'] for r in sub))}; "
                  f"{', '.join(columns)}) is a line of [cells.csv](cells.csv).", ""]
        lines += ["The last layer's attention at each size (entropy in nats minus log(keys / keys at 1x), mean distance in "
                  "training-grid cells; interpolate mode, mean over heads, seeds and the first --diagnostics test images) is "
                  "in the same lines of [cells.csv](cells.csv).", ""]
        # Interpolate mode is the study's route; extrapolate mode is the one FIRE's and LookHere's papers claim for.
        lines += [f"### {data}: the literature's orderings (change from 1x in points; interpolate mode, then extrapolate)", ""]
        for better, worse, scale, source in ORDERINGS:
            col = f"{scale:g}x"
            moving = [r for r in (better, worse) if not all(s["converged"] for s in run_info.get(r, {}).values())]
            for mode, prefix in (("interpolate", f"- {source}: "), ("extrapolate", "  - extrapolate mode: ")):
                a, b = drops(group, data, better, mode, col), drops(group, data, worse, mode, col)
                if a and b:
                    lines.append(f"{prefix}{better} {statistics.fmean(a):+.1f} ({n_seeds(a)}) vs {worse} "
                                 f"{statistics.fmean(b):+.1f} ({n_seeds(b)}) at {col}: {ordering_verdict(better, a, worse, b, moving)}")
                elif mode == "interpolate":
                    lines.append(f"{prefix}not measured yet")
        floor = TARGET_FLOOR[data]
        best = best_rows(rows, data, floor)
        lines += ["", f"### {data}: smallest loss at 2x among rows at least {100 * floor:.0f}% at 1x (coordinate route)", ""]
        lines += [f"- {row} ({label}): {100 * one:.1f}% at 1x, {d:+.1f} at 2x, {points(drop(group, data, row, label, '4x'))} at 4x"
                  for d, row, label, one in best[:5]] or ["- none yet"]
        lines.append("")
        limits = " and ".join(f"{limit:g} at {c}" for c, limit in TARGET_LOSS[data].items())
        per_row = {row: target_cells(group, data, row) for row in run_info}
        seeds = sorted({seed for per_seed in per_row.values() for seed in per_seed})
        lines += [f"### {data}: seeds meeting the target (at least {100 * floor:.0f}% at 1x, losing at most {limits}; "
                  f"interpolate mode; each seed's top-1 at 1x, then its change at {', '.join(TARGET_LOSS[data])}; bold: met)", "",
                  "| row | met | " + " | ".join(f"seed {s}" for s in seeds) + " |", "| --- | ---: | " + " | ".join("---:" for _ in seeds) + " |"]
        for row, per_seed in per_row.items():
            if not per_seed:
                continue
            shown = {seed: ", ".join([f"{one:.1f}%"] + [points(change[c]) for c in TARGET_LOSS[data]]) for seed, (one, change, _) in per_seed.items()}
            met, n = seeds_met(per_seed)
            lines.append(f"| {row} | {met} of {n} | "
                         + " | ".join("-" if s not in shown else f"**{shown[s]}**" if per_seed[s][2] else shown[s] for s in seeds) + " |")
        lines.append("")
        plot(sub, group, data, out)
    (out / "table.md").write_text("\n".join(lines))
    write_csv(cell_rows, out / "cells.csv")
    summary = ["Generated by `python -m benchmarks.resolution_transfer --report`: the tables of docs/resolution_transfer.md. "
               "Top-1 % at the training size (mean ± sd over seeds), then the change from it in points at 2x (and 4x), "
               "interpolated coordinates unless the column says otherwise.", ""]
    for data in DATASETS:
        if any(r["data"] == data for r in rows):
            summary += [f"## {data}", "", *summary_table(rows, data), "",
                        f"### {data}: extrapolated coordinates (change from 1x in points)", "", *extrapolation_table(rows, data), ""]
    (out / "summary.md").write_text("\n".join(summary))
    (out / "trained.md").write_text("\n".join(trained_table(load_trained(out))))


def change_cell(group: Dict, data: str, row: str, label: str, column: str) -> str:
    """A change from 1x as the report's summary writes it: mean ± sd over seeds (the mean alone for one seed)."""
    values = drops(group, data, row, label, column)
    if not values:
        return "-"
    m, sd = mean_sd(values)
    return f"{m:+.1f}" if len(values) == 1 else f"{m:+.1f} ± {sd:.1f}"


def summary_table(rows: List[Dict], data: str) -> List[str]:
    """The report's table for ``data``: per family, top-1 at 1x trained at one size, then the change at 2x (and 4x) on
    each recipe and route that matters: one size interpolated, one size through the patch route, with coordinate
    augmentation (per batch where that is the family's row), and trained at several sizes."""
    group = cells(rows)
    measured = {r["pe"] for r in rows if r["data"] == data}
    families = [pe for pe in vitpe.list_pos_embeds() if pe in measured]
    n = lambda row: len(group.get((data, row, "interpolate", "1x"), []))  # noqa: E731
    lines = ["| family | seeds | 1x top-1 % | 2x: one size | 2x: patch route | 2x: coord. aug. | 2x / 4x: several sizes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for pe in families:
        augs = [f"{pe}:{v}" for v in COORD_AUG if (data, f"{pe}:{v}", "interpolate", "1x") in group]  # per image, then per batch
        several = f"{pe}:multires"
        lines.append(f"| {pe} | {n(pe)} | {fmt(group.get((data, pe, 'interpolate', '1x')))} | "
                     f"{change_cell(group, data, pe, 'interpolate', '2x')} | {change_cell(group, data, pe, 'patch', '2x')} | "
                     + (" / ".join(f"{change_cell(group, data, a, 'interpolate', '2x')}{' (per batch)' if a.endswith('augbatch') else ''}"
                                   for a in augs) + " | " if augs else "- | ")
                     + f"{change_cell(group, data, several, 'interpolate', '2x')} / {change_cell(group, data, several, 'interpolate', '4x')} |")
    return lines


def extrapolation_table(rows: List[Dict], data: str) -> List[str]:
    """The change from 1x in points with extrapolated coordinates (the mode FIRE's and LookHere's papers claim for), per
    family that reads coordinates: trained at one size (alone, then with YaRN and NTK where measured), with coordinate
    augmentation, and at several sizes."""
    group = cells(rows)
    measured = {r["pe"] for r in rows if r["data"] == data}
    families = [pe for pe in vitpe.list_pos_embeds() if pe in measured and (data, pe, "extrapolate", "2x") in group]
    lines = ["| family | one size: 1.5x / 2x / 4x | one size + YaRN / NTK: 2x | coord. aug.: 1.5x / 2x | several sizes: 2x / 4x |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for pe in families:
        augs = [f"{pe}:{v}" for v in COORD_AUG if (data, f"{pe}:{v}", "extrapolate", "2x") in group]
        scaled = [change_cell(group, data, pe, f"extrapolate+{s}", "2x") for s in ("yarn", "ntk")]
        lines.append(f"| {pe} | {' / '.join(change_cell(group, data, pe, 'extrapolate', c) for c in ('1.5x', '2x', '4x'))} | "
                     + (" / ".join(scaled) if scaled != ["-", "-"] else "-") + " | "
                     + ("; ".join(f"{change_cell(group, data, a, 'extrapolate', '1.5x')} / {change_cell(group, data, a, 'extrapolate', '2x')}"
                                  f"{' (per batch)' if a.endswith('augbatch') else ''}" for a in augs) or "-") + " | "
                     + f"{change_cell(group, data, pe + ':multires', 'extrapolate', '2x')} / "
                       f"{change_cell(group, data, pe + ':multires', 'extrapolate', '4x')} |")
    return lines


def grid_entropy(r: Dict, group: Dict) -> Optional[float]:
    """The last layer's attention entropy in training-grid units: nats minus log(keys / keys at 1x). An attention that
    keeps its pattern in the image when the grid gets denser keeps this value; one that concentrates (the entropy
    collapse the 2025-26 extrapolation studies describe) lowers it, one that spreads raises it."""
    one = group.get((r["data"], r["row"], r["label"], "1x"))
    if not r.get("attn_entropy") or not one:
        return None
    return r["attn_entropy"][-1] - math.log(r["tokens_per_image"] / one[0]["tokens_per_image"])


def curve(group: Dict, data: str, row: str, label: str = "interpolate") -> List[Tuple[float, float]]:
    """(scale, mean top-1 % over seeds) at the square sizes on ``label``'s route, where measured."""
    pts = []
    for s in SCALES:
        g = group.get((data, row, label, f"{s:g}x"))
        if g:
            pts.append((s, statistics.fmean(100 * r["top1"] for r in g)))
    return pts


# The rows each panel of the figures draws as lines (the rest of the panel is a grey band): the control without position,
# the default, and one family of each kind (learned, rotary, bias, distance function).
HIGHLIGHT = ("none", "sincos2d", "learned", "rope_mixed", "cpb", "fire")
PANELS = (("plain", "interpolate", "trained at one size: coordinates interpolated"),
          ("plain", "patch", "trained at one size: patch route (FlexiViT)"),
          ("aug", "interpolate", "with coordinate augmentation (:aug)"),
          ("multires", "interpolate", "trained at 0.5x-2x (:multires)"))


def plot(sub: List[Dict], group: Dict, data: str, out: Path) -> None:
    """DATA.png: top-1 against scale, one panel per recipe and route, each with HIGHLIGHT's rows as lines and every
    other row as a grey band; the training size and chance marked."""
    from vitpe.viz import pyplot
    from vitpe.viz.plots import draw_series

    plt = pyplot()
    panels = [p for p in PANELS if any(r["variant"] == p[0] and r["label"] == p[1] for r in sub)]
    if not panels:
        return
    size, chance = sub[0]["train_size"], sub[0].get("chance")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4), sharey=True, squeeze=False)
    for ax, (variant, label, title) in zip(axes[0], panels):
        rows = dict.fromkeys(r["row"] for r in sub if r["variant"] == variant and r["label"] == label)
        series = {row: curve(group, data, row, label) for row in rows}
        draw_series(ax, {row.partition(":")[0]: pts for row, pts in series.items() if pts}, keep=HIGHLIGHT,
                    colours={pe: f"C{i}" for i, pe in enumerate(HIGHLIGHT)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(SCALES, [f"{s:g}x" for s in SCALES])
        ax.minorticks_off()
        ax.axvline(1.0, color="grey", lw=0.8, ls=":")
        ax.annotate(f"trained at {size} px", (1.0, 0.98), xycoords=("data", "axes fraction"), xytext=(3, 0),
                    textcoords="offset points", fontsize=7, color="grey", rotation=90, va="top")
        if chance:  # records of synthetic rows have none
            ax.axhline(100 * chance, color="grey", lw=0.8, ls="--")
            ax.annotate(f"chance {100 * chance:.3g}%", (4.0, 100 * chance), xytext=(-2, 2), textcoords="offset points",
                        fontsize=7, color="grey", ha="right")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"test size / training size ({size} px)")
        ax.set_ylim(0, 101)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("top-1 accuracy (%), mean over seeds")
    fig.suptitle(f"{data}: accuracy away from the training size", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / f"{data}.png", dpi=100)
    plt.close(fig)


def run_jobs(argv: List[str], jobs: int, out: Path) -> int:
    """``--jobs N``: N study processes of the same command, each with its share of the cores (OMP_NUM_THREADS), which
    split the (data, row, seed) list between them through their claims. Ctrl-C or SIGTERM reaches each of them, and
    each stops at its next step boundary with its run saved, to resume."""
    import signal
    import subprocess

    if fcntl is None:
        raise SystemExit("--jobs needs POSIX file locks (fcntl), which this system lacks: run one study process per --out")
    cores = usable_cores()
    threads = max(1, cores // jobs)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    logs = [out / "runs" / f"job{k}.log" for k in range(jobs)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    print(f"--jobs {jobs}: {jobs} study processes, {threads} thread{'s' * (threads > 1)} each on {cores} cores; logs: "
          + ", ".join(map(str, logs)))
    started = time.time()
    procs = []
    for log in logs:
        with open(log, "a") as f:  # appended: a resumed study keeps the log of the first attempt
            # Their own session: a terminal's Ctrl-C reaches them once, forwarded (twice would abort without saving).
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.resolution_transfer", *argv, "--jobs", "1"], stdout=f,
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True))
    stopped_by, told = [], set()

    def forward(signum, frame) -> None:
        stopped_by.append(signum)
        for k, p in enumerate(procs):
            if p.poll() is None:
                p.send_signal(signum)
                told.add(k)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    # A process told to stop exits non-zero after saving its run: that is the stop, not a failure.
    failed = [(log, rc) for k, (log, rc) in enumerate(zip(logs, codes)) if rc != 0 and k not in told]
    minutes = (time.time() - started) / 60
    for log, rc in failed:
        print(f"{log.stem} ended with exit code {rc}: see {log}")
    if stopped_by:
        print(f"stopped by {signal.Signals(stopped_by[0]).name} after {minutes:.1f} min: the study processes still running "
              f"saved their runs at a step boundary ({out / 'runs'}/job*.log); run the same command again to resume them")
        return 128 + stopped_by[0]  # the shell's code for a process stopped by that signal
    print(f"{jobs} study processes done in {minutes:.1f} min: {out / 'table.md'}")
    if not failed:
        return 0
    return max(failed[0][1], 1)  # a process ended by a signal has a negative code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--rows", nargs="+", help="study rows (default: every family, plain, :aug and :multires)")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--config", help="one config for every dataset instead of configs/study_DATA.yaml")
    p.add_argument("--max-epochs", type=int, help="a row still moving is retrained with twice the epochs, up to this "
                                                  "(default: the recipe's epochs doubled DOUBLINGS times: 48 for shapes, 8 for fashion_mnist)")
    p.add_argument("--eval-size", type=int, default=1000, help="test images per evaluation")
    p.add_argument("--diagnostics", type=int, default=32, help="test images for the attention diagnostics (0: off)")
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    p.add_argument("--out", default=str(ROOT / "docs" / "resolution_transfer"))
    p.add_argument("--report", action="store_true", help="only rewrite the tables and plots from OUT/results.csv")
    p.add_argument("--park", action="store_true", help="copy every unfinished run, and every finished one not yet evaluated, to "
                                                       "--park-dir (stop the study first): a later study on another machine, "
                                                       "given the same --park-dir, goes on from there")
    p.add_argument("--park-dir", help="where --park puts runs and the study looks for them (outside the repository; default: "
                                      "$VITPE_PARK_DIR, else ~/.cache/vitpe/parked/OUT's name)")
    p.add_argument("--smoke", action="store_true", help="tiny config, two rows, one seed, shapes only: seconds")
    p.add_argument("--jobs", type=int, default=1, help="study processes at once, the cores split between them; each logs "
                                                        "to OUT/runs/jobK.log")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.max_epochs is not None and args.max_epochs < 1:
        p.error("--max-epochs must be at least 1")
    if args.jobs > 1 and not (args.report or args.park):
        return run_jobs(list(sys.argv[1:] if argv is None else argv), args.jobs, Path(args.out))
    if args.smoke:
        args.data, args.config, args.eval_size, args.seeds, args.diagnostics = ["shapes"], ROOT / "configs" / "tiny.yaml", 32, [0], 4
        args.max_epochs = min(args.max_epochs or 2, 2)
        args.rows = args.rows or ["learned", "rope_axial:multires"]
        args.set = args.set + ["train.epochs=1"]
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if args.park:
        return park(out, park_dir(args, out))
    if args.report:
        with study_lock(out):
            report(load_results(out), out)
        print(f"report: {out / 'table.md'}")
        return 0
    todo = [(data, row, seed) for data in args.data for seed in args.seeds for row in (args.rows or all_rows())]
    for data, row, _ in todo:
        parse_row(row)  # every row checked before the first run starts
    started = time.time()
    for data, row, seed in todo:
        with claim(out, data, row, seed) as mine:
            if not mine:
                print(f"[{data} {row} seed {seed}] another study process is on it: skipped")
                continue
            results = load_results(out)  # another process may have measured it since this one started
            why = measured_elsewhere(out, results, data, row, seed, args)
            if why:  # retraining would cost the row's whole training time to measure what is committed
                print(f"[{data} {row} seed {seed}] {why}: kept, not trained again")
                continue
            run = train_converged(data, row, seed, args, out / "runs", results)
            if measured_before(results, (data, row, seed), load_checkpoint(run)["metrics"]):
                continue
            new = evaluate_run(run, data, row, seed, args)
            with study_lock(out):
                results = load_results(out)  # what another study process merged meanwhile is kept
                results = [r for r in results if (r["data"], r["row"], r["seed"]) != (data, row, seed)] + new
                report(results, out)  # a partial study stays readable
    print(f"study done in {(time.time() - started) / 60:.1f} min: {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
