#!/usr/bin/env python
"""Fine-tuning a model you have, measured (docs/finetune.md): a model trained at one size, fine-tuned briefly at a new
one, against the same model at that size by the coordinate, patch and resize routes, and against training at many
sizes from the start (the main job's recipe), each with its training time.

    OMP_NUM_THREADS=1 nice python -m benchmarks.finetune_study --data shapes --seeds 0 1 2 --out /work/ft_study &   # two at a time:
    OMP_NUM_THREADS=1 nice python -m benchmarks.finetune_study --data shapes --seeds 0 1 2 --out /work/ft_study --shard 1/2 &
    python -m benchmarks.finetune_study --report                           # the tables (docs/finetune/table.md, finetune.md) from the record
    python -m benchmarks.finetune_study --smoke                            # seconds: the script still runs

A row is (data, arm, seed). Arms: ``multi``, the dataset's config trained at every size of [16, 48] px (the main job's
recipe); ``one``, the same at 32 px only; ``ft48``/``ft64``, ``one`` fine-tuned with ``--init`` at 48/64 px (its
``model.img_size``: the PE's reference grid becomes the new size's) for one epoch of FT_IMAGES with configs/finetune.yaml;
``ft64keep``, the same at 64 px with ``model.img_size`` kept at 32 (``train.resolutions=[64]``: the coordinates stay the
source's, interpolated); ``pe-FAMILY``, ``one`` fine-tuned at 32 px to another PE (``pe-sincos2d``: the same one, the
control). Every arm is evaluated at 32, 48 and 64 px on the full test set; ``one`` also by the patch and
resize routes. Runs (checkpoints) go to OUT/runs, outside the repository; a finished run is reused, an interrupted one
resumed. Each measured row is merged into docs/finetune/results.csv, the study's record, under a lock.

Small data from a pretrained model (``--data fashion``; Debian's ``dataset-fashion-mnist``): two image folders written
under OUT, ``fashion-pre`` (Fashion-MNIST's first five classes, 6,000 training images a class) and ``fashion-small``
(the other five, 100 a class; 100 test images a class). Arms (TRANSFER_ARMS): ``pretrain``, configs/folder.yaml on
fashion-pre; ``scratch-recipe``, configs/folder.yaml on the small folder as a user runs it; ``scratch``, the same for
configs/finetune.yaml's steps (the fine-tune's wall time); ``probe``, ``ft``, ``ft-nold``, configs/finetune.yaml from
``pretrain`` on the small folder with ``train.freeze=backbone``, as it is (layer decay 0.75), and with
``train.layer_decay=1``. Every arm's top-1 is on its own folder's test images at 32 px.

    OMP_NUM_THREADS=1 nice python -m benchmarks.finetune_study --data fashion --out /work/ft_study --shard 0/2 &   # and 1/2
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from benchmarks import studykit
from benchmarks.small_folders import read_idx
from benchmarks.studykit import TrainSpec, convergence, timm_weights, train_or_reuse, training_time
from vitpe.checkpoint import checkpoint_config, load_checkpoint, model_from_checkpoint
from vitpe.config import load_config
from vitpe.data.datasets import FMNIST_CLASSES
from vitpe.evaluation import dataset_of, evaluate_at

try:
    import fcntl
except ImportError:  # Windows: one process per record
    fcntl = None

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "finetune" / "results.csv"
CONFIGS = {"shapes": ROOT / "configs" / "shapes.yaml", "gratings": ROOT / "configs" / "gratings.yaml"}
ARMS = ("multi", "one", "ft48", "ft64", "ft64keep", "pe-sincos2d", "pe-rope_mixed", "pe-alibi2d")
# Fine-tunes: one epoch at batch 64 of this many images (the source's data, a subset at 64 px), each planned to cost at
# most 30% of the main job's training (tokens x images; measured in the record's train_time_s).
FT_IMAGES = {"ft48": 19200, "ft64": 10240, "ft64keep": 10240, "pe-sincos2d": 10240, "pe-rope_mixed": 10240, "pe-alibi2d": 10240}
SIZES = (32, 48, 64)
FIELDS = ("data", "arm", "seed", "train_time_s", "source_time_s", "steps", "converged", "route", "resolution", "n", "top1", "loss",
          "images_per_s", "feature_gap")
TIMM_MODELS = ("vit_tiny_patch16_224", "vit_small_patch16_224")
FASHION = Path("/usr/share/datasets/fashion-mnist")
TRANSFER_ARMS = ("pretrain", "scratch-recipe", "scratch", "probe", "ft", "ft-nold")
# folder -> (Fashion-MNIST classes, training images a class, test images a class)
FOLDERS = {"fashion-pre": (range(0, 5), 6000, 200), "fashion-small": (range(5, 10), 100, 100)}
FOLDER_CONFIG, FINETUNE_CONFIG = ROOT / "configs" / "folder.yaml", ROOT / "configs" / "finetune.yaml"
SHORT: List[str] = []  # --smoke: overrides that make every small-data run a few steps


def arm_args(data: str, arm: str, seed: int, out: Path) -> TrainSpec:
    """The run of an arm."""
    if arm in ("multi", "one"):
        return TrainSpec(str(CONFIGS[data]), (f"train.seed={seed}", "train.resolution_range=" + ("[16, 48]" if arm == "multi" else "null")))
    source = out / "runs" / f"{data}-one-seed{seed}"
    size = ["train.resolutions=[64]"] if arm == "ft64keep" else [f"model.pos_embed={arm[3:]}"] if arm.startswith("pe-") else \
        [f"model.img_size={arm[2:]}"]
    steps = FT_IMAGES[arm] // 64
    sets = [f"train.seed={seed}", f"data.train_size={FT_IMAGES[arm]}", f"train.steps={steps}", f"train.warmup_steps={steps // 10}", *size]
    return TrainSpec(None, (f"init.source={source}", *sets))


def transfer_args(arm: str, seed: int, out: Path) -> TrainSpec:
    """The run of an arm of the small-data part (folders under ``out``)."""
    seed_set = [f"train.seed={seed}", *SHORT]
    if arm == "pretrain":
        return TrainSpec(str(FOLDER_CONFIG), (f"data.name=imagefolder:{out / 'fashion-pre'}", *seed_set))
    small = [f"data.name=imagefolder:{out / 'fashion-small'}", *seed_set]
    if arm == "scratch-recipe":
        return TrainSpec(str(FOLDER_CONFIG), tuple(small))
    if arm == "scratch":  # the fine-tune's steps and warm-up: the same model and batch, so the same wall time
        recipe = load_config(str(FINETUNE_CONFIG)).train
        return TrainSpec(str(FOLDER_CONFIG), (*small, f"train.steps={recipe.steps}", f"train.warmup_steps={recipe.warmup_steps}", *SHORT))
    sets = {"probe": ["train.freeze=backbone"], "ft": [], "ft-nold": ["train.layer_decay=1.0"]}[arm]
    # the folder recipe's augmentation, as the scratch arms have it
    return TrainSpec(None, (f"data.name=imagefolder:{out / 'fashion-small'}", f"init.source={out / 'runs' / f'fashion-pretrain-seed{seed}'}",
                            *seed_set, f"data.augment={load_config(str(FOLDER_CONFIG)).data.augment}", *sets))


def write_folders(out: Path, arrays: Dict[str, Tuple[np.ndarray, np.ndarray]]) -> None:
    """FOLDERS under ``out`` as a user has them (a sub-folder of PNG files a class, train/ and test/) from ``arrays``
    (split -> images, labels); each appears whole or not at all."""
    from PIL import Image

    for name, (classes, n_train, n_test) in FOLDERS.items():
        root = out / name
        if root.is_dir():
            continue
        part = root.with_name(name + ".partial")
        shutil.rmtree(part, ignore_errors=True)
        for split, per_class in (("train", n_train), ("test", n_test)):
            x, y = arrays[split]
            for c in classes:
                folder = part / split / FMNIST_CLASSES[c].replace("/", "-")
                folder.mkdir(parents=True)
                for i in np.flatnonzero(y == c)[:per_class]:
                    Image.fromarray(x[i]).save(folder / f"{i:05d}.png")
        part.rename(root)


def fashion_arrays() -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    if not FASHION.is_dir():
        raise SystemExit(f"no Fashion-MNIST at {FASHION}: apt-get install dataset-fashion-mnist")
    return {split: (read_idx(FASHION / f"{p}-images-idx3-ubyte"), read_idx(FASHION / f"{p}-labels-idx1-ubyte"))
            for split, p in (("train", "train"), ("test", "t10k"))}


def measure(run: Path, data: str, arm: str, seed: int, source: Optional[Path], test_size: Optional[int]) -> List[Dict]:
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    ds = dataset_of(cfg, test_size=test_size)
    verdict = convergence(state["metrics"])
    per_epoch = (cfg.data.train_size if data in CONFIGS else len(ds.split(True)[1])) // cfg.train.batch_size  # a folder: all it holds
    base = {"data": data, "arm": arm, "seed": seed, "train_time_s": verdict["train_time_s"], "converged": verdict["converged"],
            "source_time_s": round(training_time(load_checkpoint(source)["metrics"]), 3) if source else 0.0,  # a smoke source: 0.04 s
            "steps": cfg.train.epochs * per_epoch}
    sizes = SIZES if data in CONFIGS else (cfg.model.img_size,)  # a folder's model at its own size
    plan = [("interpolate", "coords", (s, s)) for s in sizes]
    if arm == "one":
        plan += [("interpolate", route, (s, s)) for s in SIZES[1:] for route in ("patch", "resize")]
    rows = []
    for r in evaluate_at(model, ds, plan, torch.device("cpu"), desc=f"{data} {arm} s{seed}"):
        rows.append({**base, **{k: r[k] for k in ("route", "resolution", "n")}, "top1": round(r["top1"], 5), "loss": round(r["loss"], 4)})
        print(f"[{data} {arm} seed {seed}] {r['route']:<7} {r['resolution']:>4}: top-1 {100 * r['top1']:.2f}", flush=True)
    return rows


def timm_speed(name: str, out: Path, images: int = 256, size: int = 224) -> Dict:
    """A fine-tune of timm's ``name`` from a weights file (here timm's random initialisation: nothing is downloaded) on a
    folder of ``images`` photos-sized JPEGs at ``size`` px, one epoch, batch 32: its training images per second (the
    epoch after the first, which pays for allocation), and whether its features equal timm's own model built at 160 px
    from the same file."""
    import timm
    from PIL import Image

    import vitpe

    folder = out / "timm-folder"
    if not folder.is_dir():
        gen = torch.Generator().manual_seed(0)
        for i in range(images + 64):
            split, cls = ("train" if i < images else "test"), f"c{i % 2}"
            (folder / split / cls).mkdir(parents=True, exist_ok=True)
            pixels = (torch.rand(size, size, 3, generator=gen) * 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).save(folder / split / cls / f"{i}.jpg", quality=90)
    weights = timm_weights(out, name)
    run = out / "runs" / f"timm-{name}"
    if not finished(run):
        train_or_reuse(run, TrainSpec(None, (f"data.name=imagefolder:{folder}", "train.epochs=2", f"init.source=timm:{name}",
                                             f"init.weights={weights}", "train.batch_size=32", "train.eval_batch_size=64")), run.name)
    metrics = load_checkpoint(run)["metrics"]
    ours = vitpe.init_from(f"timm:{name}", weights=str(weights), num_classes=1000, img_size=160).eval()
    theirs = timm.create_model(name, pretrained=True, img_size=160, pretrained_cfg_overlay=dict(file=str(weights))).eval()
    x = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        gap = (ours.forward_head(ours.forward_features(x), True) - theirs.forward_head(theirs.forward_features(x), True)).abs().max()
    return {"data": "imagefolder", "arm": f"timm:{name}", "seed": 0, "train_time_s": metrics[-1]["epoch_s"], "source_time_s": 0.0,
            "steps": images // 32, "converged": False, "route": "speed", "resolution": size, "n": images,
            "images_per_s": round(metrics[-1]["images_per_s"], 2), "feature_gap": float(f"{gap:.3g}")}


# ---- the record ----------------------------------------------------------------------------------------------------
def load_results(path: Path = RECORD) -> List[Dict]:
    if not path.is_file():
        return []
    ints, floats = {"seed", "steps", "resolution", "n"}, {"train_time_s", "source_time_s", "top1", "loss", "images_per_s", "feature_gap"}
    with open(path, newline="") as f:
        return [{k: int(v) if k in ints else float(v) if k in floats and v != "" else (v == "True") if k == "converged" else v
                 for k, v in r.items()} for r in csv.DictReader(f)]


def save_results(rows: List[Dict], path: Path = RECORD) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n", restval="")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (r["data"], r["arm"], r["seed"], r["route"], r["resolution"])))
    tmp.replace(path)


@contextlib.contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def finished(run: Path) -> bool:
    """Whether ``run`` has trained all its epochs (another process may still be training it)."""
    if not (run / "checkpoint.pt").is_file():
        return False
    state = load_checkpoint(run)
    return state["epoch"] >= checkpoint_config(state).train.epochs


def measured(rows: List[Dict], data: str, arm: str, seed: int) -> bool:
    return any((r["data"], r["arm"], r["seed"]) == (data, arm, seed) for r in rows)


# ---- the report ----------------------------------------------------------------------------------------------------
mean_sd = functools.partial(studykit.mean_sd, digits=1)  # this study's cells: one decimal


def table(rows: List[Dict], data: str) -> str:
    """Top-1 (%) at each size and training minutes per arm and route, mean ± sd over seeds."""
    lines = [f"| {data}: arm (route) | seeds | training min (its own + the source's) | " + " | ".join(f"{s} px" for s in SIZES) + " |",
             "| --- | --- | --- |" + " --- |" * len(SIZES)]
    for arm in ARMS:
        for route in ("coords", "patch", "resize"):
            mine = [r for r in rows if (r["data"], r["arm"], r["route"]) == (data, arm, route)]
            if not mine:
                continue
            seeds = sorted({r["seed"] for r in mine})
            runs = {r["seed"]: r for r in mine}.values()
            minutes = mean_sd([(r["train_time_s"] + r["source_time_s"]) / 60 for r in runs])
            own = mean_sd([r["train_time_s"] / 60 for r in runs])
            cells = [mean_sd([100 * r["top1"] for r in mine if r["resolution"] == s]) for s in SIZES]
            lines.append(f"| {arm} ({route}) | {len(seeds)} | {minutes} ({own} own) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


TRANSFER_WHAT = {"pretrain": "the source: configs/folder.yaml on fashion-pre (its own 5 classes)",
                 "scratch-recipe": "from scratch: configs/folder.yaml on the small folder", "scratch": "from scratch, the fine-tune's steps",
                 "probe": "--init the source, train.freeze=backbone", "ft": "--init the source (layer decay 0.75)",
                 "ft-nold": "--init the source, train.layer_decay=1"}


def transfer_table(rows: List[Dict]) -> str:
    """The small-data part: each arm's top-1 (%) on its folder's test images and its training minutes, mean ± sd over seeds."""
    lines = ["| fashion: arm | what it is | seeds | steps | training min (its own + the source's) | top-1 at 32 px |",
             "| --- | --- | --- | --- | --- | --- |"]
    for arm in TRANSFER_ARMS:
        mine = [r for r in rows if (r["data"], r["arm"]) == ("fashion", arm)]
        if mine:
            minutes = mean_sd([(r["train_time_s"] + r["source_time_s"]) / 60 for r in mine])
            own = mean_sd([r["train_time_s"] / 60 for r in mine])
            lines.append(f"| {arm} | {TRANSFER_WHAT[arm]} | {len(mine)} | {mine[0]['steps']:,} | {minutes} ({own} own) | "
                         f"{mean_sd([100 * r['top1'] for r in mine])} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def timm_table(rows: List[Dict]) -> str:
    speed = [r for r in rows if r["route"] == "speed"]
    if not speed:
        return ""
    lines = ["| timm model, --init timm:NAME | training images/s at 224 px | one epoch of 1,000 images | features vs timm's own at 160 px |",
             "| --- | --- | --- | --- |"]
    for r in speed:
        lines.append(f"| {r['arm'][len('timm:'):]} | {r['images_per_s']:.1f} | {1000 / r['images_per_s'] / 60:.1f} min | {r['feature_gap']:.1e} |")
    return "\n".join(lines) + "\n"


def with_tables(page: str, tables: str) -> str:
    """``page`` with each of its tables replaced by the one of ``tables`` whose first cell is the same (a table is a
    block of lines that start with ``|``)."""
    new = {block.split(" |", 1)[0]: block for block in tables.strip().split("\n\n")}
    out, lines = [], page.split("\n")
    i = 0
    while i < len(lines):
        head = lines[i].split(" |", 1)[0]
        if lines[i].startswith("| ") and head in new:
            out.append(new[head])
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def report(path: Path = RECORD, page: Optional[Path] = None) -> str:
    """The tables of the record at ``path``, written beside it (table.md) and, where ``page`` is given, in place of
    that page's tables of the same name."""
    rows = load_results(path)
    text = "".join(table(rows, d) + "\n" for d in CONFIGS if any(r["data"] == d for r in rows))
    text += "".join(t + "\n" for t in (transfer_table(rows), timm_table(rows)) if t)
    (path.parent / "table.md").write_text(text)
    if page is not None:
        page.write_text(with_tables(page.read_text(), text))
    return text


def main(argv: Optional[List[str]] = None) -> int:
    global CONFIGS, FT_IMAGES, FOLDERS, FOLDER_CONFIG, SHORT  # --smoke shrinks them
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", choices=[*CONFIGS, "fashion"], default="shapes", help="fashion: the small-data part")
    p.add_argument("--arms", nargs="+", choices=ARMS + TRANSFER_ARMS, help="default: every arm of the --data's part")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("/tmp/vitpe-finetune-study"), help="where runs (checkpoints) go, outside the repository")
    p.add_argument("--shard", default="0/1", help="K/N: this process takes every N-th row from the K-th (fine-tunes after their source)")
    p.add_argument("--timm", action="store_true", help="the timm models' fine-tuning speed (TIMM_MODELS), then stop")
    p.add_argument("--report", action="store_true", help="regenerate docs/finetune/table.md and docs/finetune.md's tables from the record, then stop")
    p.add_argument("--smoke", action="store_true", help="a tiny version of every arm, recorded beside --out, in seconds")
    args = p.parse_args(argv)
    if args.report:
        print(report(page=ROOT / "docs" / "finetune.md"))
        return 0
    record, test_size = RECORD, None
    if args.timm:
        for name in TIMM_MODELS:
            row = timm_speed(name, args.out)
            print(f"[timm:{name}] {row['images_per_s']} training images/s at 224 px; features vs timm's at 160 px: {row['feature_gap']:.2e}")
            with locked(record):
                save_results([r for r in load_results(record) if r["arm"] != row["arm"]] + [row], record)
        return 0
    transfer = args.data == "fashion"
    arms, sources = (TRANSFER_ARMS, ("pretrain",)) if transfer else (ARMS, ("one", "multi"))
    wrong = [a for a in args.arms or [] if a not in arms]
    if wrong:
        p.error(f"--arms {' '.join(wrong)}: not an arm of --data {args.data} ({', '.join(arms)})")
    chosen = args.arms or list(arms)
    if args.smoke:
        CONFIGS = {d: ROOT / "configs" / "tiny.yaml" for d in CONFIGS}
        FT_IMAGES = {k: 256 for k in FT_IMAGES}
        FOLDERS = {k: (v[0], 24, 4) for k, v in FOLDERS.items()}
        FOLDER_CONFIG, SHORT = ROOT / "configs" / "tiny.yaml", ["train.steps=4", "train.warmup_steps=1"]
        record, test_size = args.out / "results.csv", None if transfer else 64
    if transfer:
        gen = np.random.default_rng(0)  # --smoke: folders of noise, for the mechanics
        with locked(args.out / "folders"):  # the first of the N processes writes them
            write_folders(args.out, fashion_arrays() if not args.smoke else
                          {s: (gen.integers(0, 256, (240, 28, 28), dtype=np.uint8), np.arange(240) % 10) for s in ("train", "test")})
    args_of = (lambda arm, seed: transfer_args(arm, seed, args.out)) if transfer else (lambda arm, seed: arm_args(args.data, arm, seed, args.out))
    k, n = (int(x) for x in args.shard.split("/"))
    # every source first, then the other arms, dealt in turn to the N processes; one that reaches a fine-tune whose
    # source another process is still training waits for it
    todo: List[Tuple[str, int]] = [(arm, s) for s in args.seeds for arm in sources if arm in chosen]
    todo += [(arm, s) for s in args.seeds for arm in arms if arm in chosen and arm not in sources]
    for arm, seed in [t for i, t in enumerate(todo) if i % n == k]:
        with locked(record):
            if measured(load_results(record), args.data, arm, seed):
                print(f"[{args.data} {arm} seed {seed}] in the record already")
                continue
        name = f"{args.data}-{arm}-seed{seed}"
        source = None if arm in sources or arm.startswith("scratch") else args.out / "runs" / f"{args.data}-{sources[0]}-seed{seed}"
        if source is not None and not source.is_dir():
            train_or_reuse(source, args_of(sources[0], seed), source.name)
        while source is not None and not finished(source):
            print(f"[{name}] waiting for its source {source} to finish training", flush=True)
            time.sleep(30)
        run = train_or_reuse(args.out / "runs" / name, args_of(arm, seed), name)
        rows = measure(run, args.data, arm, seed, source, test_size)
        with locked(record):
            save_results([r for r in load_results(record) if (r["data"], r["arm"], r["seed"]) != (args.data, arm, seed)] + rows, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
