"""Small image folders trained by the plain command and by the small-folder recipe: what a user's own images get.

    python -m benchmarks.small_folders make --out /tmp/folders              # the folders, from data packages ship
    nice python -m benchmarks.small_folders train --out /tmp/folders --rows plain folder --seeds 0 1 2
    python -m benchmarks.small_folders table --record docs/small_folders.csv

Two real folders nobody here drew, as a user would have them (class folders of PNG files):

- ``digits``: scikit-learn's handwritten digits (1,797 8x8 grayscale scans of 10 digits, shipped inside the package;
  ``pip install scikit-learn``), upscaled to 32x32 RGB, ``train/`` 1,500 and ``test/`` 297 (split with a fixed seed).
- ``fashion``: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (``apt-get install dataset-fashion-mnist``),
  300 training images a class from its training set (3,000) and 100 a class from its test set (1,000), 28x28 grayscale.

A row is a command line (``ROWS``); each run appends one line to the record (``--record``, a CSV): the folder, row, seed,
epochs, optimizer steps, training seconds (the run's own clock), final test top-1. Finished runs are skipped, so an
interrupted study continues where it stopped; run directories go under ``--out``, outside the repository.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "small_folders.csv"
FOLDERS = ("digits", "fashion")
ROWS: Dict[str, List[str]] = {  # what follows `python train.py --data imagefolder:FOLDER`
    "plain": [],  # the README's command as it is: shapes' recipe, its schedule sized by work
    "folder": ["--config", "configs/folder.yaml"],
}
FIELDS = ("folder", "row", "seed", "epochs", "steps", "train_s", "top1", "args", "when")


def make_digits(out: Path) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.RandomState(0).permutation(len(d.target))
    for rank, i in enumerate(order):
        split = "train" if rank < 1500 else "test"
        folder = out / split / str(d.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (d.images[i] * 255 / 16).round().astype(np.uint8)  # 17 grey levels, 0..16
        Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's and Fashion-MNIST's format), or its ``.gz``, as an array."""
    raw = gzip.open(f"{path}.gz").read() if not path.exists() else path.read_bytes()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], "big") for k in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def make_fashion(out: Path, source: Path = Path("/usr/share/datasets/fashion-mnist")) -> None:
    from PIL import Image

    from vitpe.data.datasets import FMNIST_CLASSES

    for split, prefix, per_class in (("train", "train", 300), ("test", "t10k", 100)):
        x, y = read_idx(source / f"{prefix}-images-idx3-ubyte"), read_idx(source / f"{prefix}-labels-idx1-ubyte")
        for c, name in enumerate(FMNIST_CLASSES):
            folder = out / split / name.replace("/", "-")
            folder.mkdir(parents=True, exist_ok=True)
            for i in np.flatnonzero(y == c)[:per_class]:
                Image.fromarray(x[i]).save(folder / f"{i:05d}.png")


def done(record: Path) -> set:
    if not record.is_file():
        return set()
    with open(record) as f:
        return {(r["folder"], r["row"], int(r["seed"])) for r in csv.DictReader(f)}


def train(out: Path, folder: str, row: str, seed: int, record: Path) -> Dict:
    name = f"{folder}-{row.replace(':', '_')}-s{seed}"
    run = out / "runs" / name
    args = [sys.executable, "train.py", "--data", f"imagefolder:{out / folder}", *ROWS[row], "--set", f"train.seed={seed}",
            "--out-dir", str(out / "runs"), "--name", name]
    if run.exists():  # an interrupted run goes on where it stopped
        args = [sys.executable, "train.py", "--resume", str(run)]
    subprocess.run(args, cwd=ROOT, check=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    entry = {"folder": folder, "row": row, "seed": seed, "epochs": len(rows),
             "steps": len(rows) * _steps_per_epoch(out / folder, cfg["train"]["batch_size"]), "train_s": round(rows[-1]["wall_s"], 1),
             "top1": round(rows[-1]["test_top1"], 4), "args": " ".join(ROWS[row]), "when": time.strftime("%Y-%m-%d %H:%M")}
    new = not record.is_file()
    with open(record, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow(entry)
    return entry


def _steps_per_epoch(folder: Path, batch: int) -> int:
    return sum(1 for p in (folder / "train").rglob("*.png")) // batch


def table(record: Path) -> str:
    with open(record) as f:
        rows = list(csv.DictReader(f))
    out = ["| folder | row | seeds | epochs | steps | training s | test top-1 |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key in dict.fromkeys((r["folder"], r["row"]) for r in rows):
        mine = [r for r in rows if (r["folder"], r["row"]) == key]
        top = [100 * float(r["top1"]) for r in mine]
        secs = [float(r["train_s"]) for r in mine]
        sd = float(np.std(top, ddof=1)) if len(top) > 1 else 0.0
        out.append(f"| {key[0]} | {key[1]} | {len(mine)} | {mine[0]['epochs']} | {mine[0]['steps']} | {min(secs):.0f}-{max(secs):.0f} | "
                   f"{np.mean(top):.1f} ± {sd:.1f} (min {min(top):.1f}) |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("make", "train", "table"))
    p.add_argument("--out", type=Path, default=Path("/tmp/vitpe-small-folders"), help="folders and runs (outside the repository)")
    p.add_argument("--folders", nargs="+", default=list(FOLDERS), choices=FOLDERS)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--record", type=Path, default=RECORD)
    args = p.parse_args(argv)
    if args.what == "make":
        for folder, make in (("digits", make_digits), ("fashion", make_fashion)):
            if folder in args.folders and not (args.out / folder).exists():
                make(args.out / folder)
                print(f"made {args.out / folder}")
        return 0
    if args.what == "table":
        print(table(args.record))
        return 0
    finished = done(args.record)
    for seed in args.seeds:
        for folder in args.folders:
            for row in args.rows:
                if (folder, row, seed) not in finished:
                    print(train(args.out, folder, row, seed, args.record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
