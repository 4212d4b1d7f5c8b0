#!/usr/bin/env python
"""An image folder held in memory against the same folder read a batch at a time (issue 107; the record
docs/data/streaming.jsonl, the table docs/data/table.md).

Folders of photo-sized JPEGs (640x480: the shapes dataset enlarged, with noise of their own; 10 class folders) are made
once under OUT. Each measurement runs in a fresh process, one at a time:

- ``first``: from ``load_dataset`` to the first training batch decoded (128 images at the size, content scale crops),
  with the process's peak memory above what it held after its imports (``ru_maxrss``);
- ``train``: ``train.py`` on the folder for a fixed number of steps, its images/s and the share of step time spent
  waiting for data (the run's own ``images_per_s`` and ``data_time_frac``) in its first epoch and over the later ones;
- ``step``: from the process's start to the end of the first training step of a ViT-Ti/16 fine-tune at 224 px;
- ``ddp``: the 2,000-photo folder written as tar shards (``vitpe shards``), trained to the end of ``configs/folder.yaml``
  at ``DDP_STEPS`` steps by one process and by ``torchrun`` with two, three seeds each: the test top-1 each reaches.

    nice python -m benchmarks.streaming --out /tmp/streaming --make 2000 20000
    nice python -m benchmarks.streaming --out /tmp/streaming --rows first-2000-memory first-2000-stream first-20000-stream
    nice python -m benchmarks.streaming --out /tmp/streaming --ddp 0 1 2
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

from benchmarks.studykit import mean_sd, timm_weights
from benchmarks.timing import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "data" / "streaming.jsonl"
CLASSES = 10
PHOTO = (480, 640)  # (h, w): a phone photo's proportions at a size a folder of photos holds

# row -> (kind, images in the folder, training size, how it is read: memory | stream | shards, extra train.py arguments)
VIT_TI = ("--init", "timm:vit_tiny_patch16_224", "--set", "train.batch_size=32", "--set", "train.steps=20")  # the 224-px fine-tune
ROWS: Dict[str, tuple] = {
    "first-2000-memory": ("first", 2000, 224, "memory", ()),
    "first-2000-stream": ("first", 2000, 224, "stream", ()),
    "first-20000-stream": ("first", 20000, 224, "stream", ()),
    "step-2000-stream": ("step", 2000, 224, "stream", ()),
    "step-20000-stream": ("step", 20000, 224, "stream", ()),
    "train32-2000-memory": ("train", 2000, 32, "memory", ()),
    "train32-2000-stream-w0": ("train", 2000, 32, "stream", ("--set", "data.workers=0")),
    "train32-2000-stream-w2": ("train", 2000, 32, "stream", ("--set", "data.workers=2")),
    "train32-2000-stream-nocache-w0": ("train", 2000, 32, "stream", ("--set", "data.cache=false", "--set", "data.workers=0")),
    "train32-2000-shards-w0": ("train", 2000, 32, "shards", ("--set", "data.workers=0")),
    "train224-2000-stream-w0": ("train", 2000, 224, "stream", (*VIT_TI, "--set", "data.workers=0")),
    "train224-2000-stream-w2": ("train", 2000, 224, "stream", (*VIT_TI, "--set", "data.workers=2")),
}
PATHS = {"memory": "in memory", "stream": "streamed", "shards": "tar shards"}

DDP_STEPS = 1500  # configs/folder.yaml's 2,500 steps, shortened so that six runs fit in half an hour on 2 cores
DDP_PORT = 29541

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
print(json.dumps({"loaded_s": loaded, "first_batch_s": time.perf_counter() - t0, "first_batch_at": time.time(),
                  "peak_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
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


# From the process's start to the end of the first training step of ViT-Ti/16 at 224 px (argv: folder, weights, runs):
# train.py's own path, the step timed by wrapping Job.update, and the process left at once.
STEP = """
import json, sys, time
from vitpe import training
real = training.Job.update
def update(job, *args):
    out = real(job, *args)
    print(json.dumps({"first_step_at": time.time()}), flush=True)
    raise SystemExit(0)
training.Job.update = update
training.train(None, ["data.name=imagefolder:" + sys.argv[1], "data.stream=true", "init.source=timm:vit_tiny_patch16_224",
                      "init.weights=" + sys.argv[2], "train.batch_size=32", "train.amp=none", "data.crop_scale=[0.35, 1.0]",
                      "out_dir=" + sys.argv[3]])
"""


def measure(out: Path, row: str, steps: int) -> Dict:
    kind, n, size, path, extra = ROWS[row]
    folder = make_folder(out, n)
    if kind == "first":
        launched = time.time()
        r = subprocess.run([sys.executable, "-c", FIRST, str(folder), str(size), "1" if path == "stream" else "0"], cwd=ROOT, capture_output=True,
                           text=True, check=True)
        result = json.loads(r.stdout.strip().splitlines()[-1])
        result["from_start_s"] = result.pop("first_batch_at") - launched  # the interpreter's start and the imports as well
    elif kind == "step":
        launched = time.time()
        r = subprocess.run([sys.executable, "-c", STEP, str(folder), str(timm_weights(out, "vit_tiny_patch16_224")), str(out / "runs")],
                           cwd=ROOT, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith('{"first_step_at"')), None)
        if line is None:
            raise SystemExit(r.stderr[-2000:])
        result = {"first_step_s": json.loads(line)["first_step_at"] - launched}
    else:
        if "--init" in extra:  # a timm model's own initialisation as the file --init-weights takes: nothing is downloaded
            extra = (*extra, "--init-weights", str(timm_weights(out, extra[extra.index("--init") + 1].split(":", 1)[1])))
        run = out / "runs" / row
        data = ["--data", f"shards:{shards_of(out, folder)}"] if path == "shards" else ["--data", f"imagefolder:{folder}", "--set",
                                                                                          f"data.stream={str(path == 'stream').lower()}"]
        cmd = [sys.executable, "train.py", *data, "--set", f"model.img_size={size}",
               "--set", f"train.steps={steps}", "--set", "train.warmup_steps=0", "--set", "train.amp=none", "--set", "data.crop_scale=[0.35, 1.0]",
               "--out-dir", str(run.parent), "--name", f"{run.name}-{int(time.time())}", *extra]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        last = sorted((run.parent).glob(f"{run.name}-*"))[-1]
        metrics = [json.loads(line) for line in (last / "metrics.jsonl").read_text().splitlines()]
        later = metrics[1:] or metrics  # after the first epoch, which fills the decoded cache
        seconds = sum(m["epoch_s"] for m in later)
        result = {"images_per_s": round(sum(m["images_per_s"] * m["epoch_s"] for m in later) / seconds, 1),
                  "data_time_frac": round(sum(m["data_time_frac"] * m["epoch_s"] for m in later) / seconds, 4),
                  "first_epoch_images_per_s": round(metrics[0]["images_per_s"], 1), "epochs": len(metrics), "steps": steps}
    return {"row": row, "kind": kind, "images": n, "size": size, "path": path, "cpu": cpu_name(), "torch": torch.__version__,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}}


def shards_of(out: Path, folder: Path) -> Path:
    """``folder`` written as tar shards under ``out``, once."""
    from vitpe.data.shard_writer import write_shards

    shards = out / folder.name.replace("photos", "shards")
    if not (shards / "shards.json").is_file():
        write_shards(folder, shards)
    return shards


def train_ddp(out: Path, processes: int, seed: int, steps: int = DDP_STEPS) -> Dict:
    """One run on the 2,000 photos' shards by ``processes`` processes (1: ``train.py``; more: ``torchrun``)."""
    shards = shards_of(out, make_folder(out, 2000))
    name = f"ddp{processes}-s{seed}-{int(time.time())}"
    args = ["train.py", "--config", "configs/folder.yaml", "--data", f"shards:{shards}", "--set", f"train.steps={steps}",
            "--set", f"train.seed={seed}", "--set", "train.amp=none", "--set", "data.workers=0", "--out-dir", str(out / "runs"), "--name", name]
    launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                                                       "--master_port", str(DDP_PORT)]
    env = None if processes == 1 else {**__import__("os").environ, "OMP_NUM_THREADS": str(max(1, (torch.get_num_threads()) // processes))}
    t0 = time.perf_counter()
    r = subprocess.run(launch + args, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    metrics = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {"row": f"ddp-{processes}-s{seed}", "kind": "ddp", "images": 2000, "size": 32, "path": "shards", "processes": processes, "seed": seed,
            "steps": steps, "test_top1": round(metrics[-1]["test_top1"], 4), "train_s": round(sum(m["epoch_s"] for m in metrics), 1),
            "wall_s": round(time.perf_counter() - t0, 1), "cpu": cpu_name(), "torch": torch.__version__}


def median_of(results: List[Dict]) -> Dict:
    """One row from repeated measurements: the run of median images/s (or seconds to the first step), with every
    run's value beside it."""
    key = "images_per_s" if "images_per_s" in results[0] else "first_step_s"
    ranked = sorted(results, key=lambda r: r[key])
    return {**ranked[len(ranked) // 2], f"runs_{key}": [round(r[key], 3) for r in results]}


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
             "| row | images | size | path | to the first batch (s) | from the process's start (s) | peak memory above imports (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in (r for r in rows if r["kind"] == "first"):
        lines.append(f"| {r['row']} | {r['images']:,} | {r['size']} | {PATHS[r['path']]} | {r['first_batch_s']:.1f} | "
                     f"{r['from_start_s']:.1f} | {r['peak_mb']:.0f} |")
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        lines += ["", "| row | images | from the process's start to the end of the first step of ViT-Ti/16 at 224 px (s) |", "| --- | --- | --- |"]
        lines += [f"| {r['row']} | {r['images']:,} | {r['first_step_s']:.1f} |" for r in steps]
    lines += ["", "| row | size | path | data.workers | data.cache | images/s, first epoch | images/s, later epochs | against memory | "
              "data share of step time |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    memory = {r["size"]: r["images_per_s"] for r in rows if r["kind"] == "train" and r["path"] == "memory"}
    for r in (r for r in rows if r["kind"] == "train"):
        extra = ROWS.get(r["row"], (None,) * 5)[4]
        workers = next((x.split("=")[1] for x in extra if x.startswith("data.workers=")), "0")
        cache = "-" if r["path"] == "memory" else "off" if "data.cache=false" in extra or r["size"] > 64 else "on"
        ratio = f"{r['images_per_s'] / memory[r['size']]:.2f}x" if r["size"] in memory else "-"
        last = f"{r['images_per_s']:.1f}" if r["epochs"] > 1 else "-"
        lines.append(f"| {r['row']} | {r['size']} | {PATHS[r['path']]} | {workers} | {cache} | {r['first_epoch_images_per_s']:.1f} | {last} | "
                     f"{ratio} | {100 * r['data_time_frac']:.0f}% |")
    ddp = [r for r in rows if r["kind"] == "ddp"]
    if ddp:
        lines += ["", "| processes | seeds | test top-1 (%) | training minutes |", "| --- | --- | --- | --- |"]
        for n in sorted({r["processes"] for r in ddp}):
            runs = [r for r in ddp if r["processes"] == n]
            lines.append(f"| {n} | {len(runs)} | {mean_sd([100 * r['test_top1'] for r in runs])} | "
                         f"{mean_sd([r['train_s'] / 60 for r in runs])} |")
    cpus = sorted({r["cpu"] for r in rows})
    return "\n".join(lines + ["", f"Measured on {', '.join(cpus)}, 2 cores, one measurement at a time."]) + "\n"



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/streaming"))
    p.add_argument("--make", type=int, nargs="*", default=[])
    p.add_argument("--rows", nargs="*", default=[], choices=sorted(ROWS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeat", type=int, default=1, help="measure the rows this many times in turn; the record keeps the median")
    p.add_argument("--ddp", type=int, nargs="*", default=[], metavar="SEED", help="the shards' runs, 1 and 2 processes, at these seeds")
    p.add_argument("--report", action="store_true")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        tiny = ("--config", "configs/tiny.yaml", "--set", "train.batch_size=8")
        ROWS.update({"first-40-stream": ("first", 40, 32, "stream", ()), "train16-40-stream": ("train", 40, 16, "stream", tiny),
                     "train16-40-shards": ("train", 40, 16, "shards", tiny)})
        rows = [measure(args.out, row, 3) for row in ("first-40-stream", "train16-40-stream", "train16-40-shards")]
        print(report(rows))
        return 0
    for n in args.make:
        make_folder(args.out, n)
    if args.repeat == 1:
        for row in args.rows:
            record([measure(args.out, row, args.steps)])  # each as it finishes: a failure later keeps what ran
    elif args.rows:  # the rows in turn, again and again: a drift of the machine's speed falls on every row alike
        runs = {row: [] for row in args.rows}
        for _ in range(args.repeat):
            for row in args.rows:
                runs[row].append(measure(args.out, row, args.steps))
        record([median_of(results) for results in runs.values()])
    for seed in args.ddp:
        for processes in (1, 2):
            if f"ddp-{processes}-s{seed}" not in {r["row"] for r in read()}:  # a study started again goes on where it stopped
                record([train_ddp(args.out, processes, seed)])  # each as it finishes: an interrupted study keeps what ran
    if args.report:
        (RECORD.parent / "table.md").write_text(report(read()))
        print(f"wrote {RECORD.parent / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
