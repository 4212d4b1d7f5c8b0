#!/usr/bin/env python
"""An image folder held in memory against the same folder read a batch at a time (issue 107; the record
docs/data/streaming.jsonl, the table docs/data/table.md).

Folders of photo-sized JPEGs (640x480: the shapes dataset enlarged, with noise of their own; 10 class folders) are made
once under OUT. Each measurement runs in a fresh process, one at a time:

- ``first``: from ``load_dataset`` to the first training batch decoded (128 images at the size, content scale crops),
  with the process's peak memory above what it held after its imports (``ru_maxrss``);
- ``train``: ``train.py`` on the folder for a fixed number of steps, its images/s and the share of step time spent
  waiting for data (the run's own ``images_per_s`` and ``data_time_frac``).

    nice python -m benchmarks.streaming --out /tmp/streaming --make 2000 20000
    nice python -m benchmarks.streaming --out /tmp/streaming --rows first-2000-memory first-2000-stream first-20000-stream
    python -m benchmarks.streaming --report
    python -m benchmarks.streaming --smoke      # seconds: the script still runs
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from benchmarks.timing import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "data" / "streaming.jsonl"
CLASSES = 10
PHOTO = (480, 640)  # (h, w): a phone photo's proportions at a size a folder of photos holds

# row -> (kind, images in the folder, training size, data.stream, extra train.py overrides)
ROWS: Dict[str, tuple] = {
    "first-2000-memory": ("first", 2000, 224, False, ()),
    "first-2000-stream": ("first", 2000, 224, True, ()),
    "first-20000-stream": ("first", 20000, 224, True, ()),
    "train32-2000-memory": ("train", 2000, 32, False, ()),
    "train32-2000-stream": ("train", 2000, 32, True, ()),
}

FIRST = """
import json, resource, sys, time
import torch
from vitpe.data import load_dataset
from vitpe.data.augment import crop_boxes
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
ds = load_dataset("imagefolder:" + sys.argv[1], image_size=(int(sys.argv[2]),) * 2, stream=sys.argv[3] == "1")
loaded = time.perf_counter() - t0
torch.manual_seed(0)
index = torch.randperm(len(ds.split(True)[1]))[:128]
x = ds.images_at(True, index, (int(sys.argv[2]),) * 2, crop_boxes(len(index), (0.35, 1.0)))
print(json.dumps({"loaded_s": loaded, "first_batch_s": time.perf_counter() - t0, "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                  "n_train": len(ds.split(True)[1]), "streamed": ds.streamed}))
"""


def make_folder(out: Path, n: int, size=PHOTO, scenes: int = 2000) -> Path:
    """``n`` JPEG photos in ``CLASSES`` class folders, made once: ``scenes`` of the shapes dataset drawn at half the
    photo's size and enlarged to it, each photo one of them with sensor-like noise of its own (so that no two files or
    pictures are the same, and a JPEG is as costly to decode as a photo's)."""
    import numpy as np
    from PIL import Image

    from vitpe.data.shapes import render_shapes, shapes_params

    folder = out / f"photos{n}"
    done = folder / ".complete"
    if done.is_file():
        return folder
    k = min(n, scenes)
    params = shapes_params(k, seed=7)
    base = [Image.fromarray(im).resize(size[::-1], Image.BICUBIC)
            for im in render_shapes(params, (size[0] // 2, size[1] // 2)).permute(0, 2, 3, 1).numpy()]
    labels = params["label"].tolist()
    for c in range(CLASSES):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(n)
    for i in range(n):
        noisy = np.asarray(base[i % k], dtype=np.int16) + rng.integers(-8, 9, (*size, 3), dtype=np.int16)
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(folder / f"class{labels[i % k]}" / f"{i:06d}.jpg", quality=90)
        if (i + 1) % 1000 == 0 or i + 1 == n:
            print(f"made {i + 1}/{n} photos in {folder}", flush=True)
    done.write_text("")
    return folder


def measure(out: Path, row: str, steps: int) -> Dict:
    kind, n, size, stream, extra = ROWS[row]
    folder = make_folder(out, n)
    if kind == "first":
        r = subprocess.run([sys.executable, "-c", FIRST, str(folder), str(size), "1" if stream else "0"], cwd=ROOT, capture_output=True,
                           text=True, check=True)
        result = json.loads(r.stdout.strip().splitlines()[-1])
    else:
        run = out / "runs" / row
        cmd = [sys.executable, "train.py", "--data", f"imagefolder:{folder}", "--set", f"model.img_size={size}", "--set", f"data.stream={str(stream).lower()}",
               "--set", f"train.steps={steps}", "--set", "train.warmup_steps=0", "--set", "train.amp=none", "--set", "data.crop_scale=[0.35, 1.0]",
               "--out-dir", str(run.parent), "--name", f"{run.name}-{int(time.time())}", *extra]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        last = sorted((run.parent).glob(f"{run.name}-*"))[-1]
        metrics = [json.loads(line) for line in (last / "metrics.jsonl").read_text().splitlines()]
        result = {"images_per_s": round(metrics[-1]["images_per_s"], 1), "data_time_frac": round(metrics[-1]["data_time_frac"], 4),
                  "steps": steps}
    return {"row": row, "kind": kind, "images": n, "size": size, "stream": stream, "cpu": cpu_name(), "torch": torch.__version__,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}}


def record(rows: List[Dict], path: Path = RECORD) -> None:
    """Add ``rows`` to the record, replacing earlier rows of the same name."""
    kept = [r for r in read(path) if r["row"] not in {x["row"] for x in rows}] if path.is_file() else []
    order = list(ROWS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(kept + rows, key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))))


def read(path: Path = RECORD) -> List[Dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def report(rows: List[Dict]) -> str:
    lines = ["# An image folder held in memory and read a batch at a time (python -m benchmarks.streaming --report)", "",
             "| row | images | size | path | to the first batch (s) | peak memory above imports (MB) | images/s | data share of step time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        path = "streamed" if r["stream"] else "in memory"
        first = f"{r['first_batch_s']:.1f}" if "first_batch_s" in r else ""
        peak = f"{r['peak_mb']:.0f}" if "peak_mb" in r else ""
        rate = f"{r['images_per_s']:.0f}" if "images_per_s" in r else ""
        share = f"{100 * r['data_time_frac']:.0f}%" if "data_time_frac" in r else ""
        lines.append(f"| {r['row']} | {r['images']:,} | {r['size']} | {path} | {first} | {peak} | {rate} | {share} |")
    cpus = sorted({r["cpu"] for r in rows})
    return "\n".join(lines + ["", f"Measured on {', '.join(cpus)}, 2 cores, one measurement at a time."]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/streaming"))
    p.add_argument("--make", type=int, nargs="*", default=[])
    p.add_argument("--rows", nargs="*", default=[], choices=sorted(ROWS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--report", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        ROWS.update({"first-40-stream": ("first", 40, 32, True, ()), "train16-40-stream": ("train", 40, 16, True, ("--config", "configs/tiny.yaml",
                                                                                                                  "--set", "train.batch_size=8"))})
        rows = [measure(args.out, row, 3) for row in ("first-40-stream", "train16-40-stream")]
        print(report(rows))
        return 0
    for n in args.make:
        make_folder(args.out, n)
    if args.rows:
        record([measure(args.out, row, args.steps) for row in args.rows])
    if args.report:
        (RECORD.parent / "table.md").write_text(report(read()))
        print(f"wrote {RECORD.parent / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
