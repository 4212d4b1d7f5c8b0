#!/usr/bin/env python
"""What makes a small ViT train faster on a CPU: each lever measured side by side in one process (issue 14).

    nice python -m benchmarks.cpu_levers                      # every part, both architectures (~25 min on 2 cores)
    python -m benchmarks.cpu_levers --parts profile --arch main
    python -m benchmarks.cpu_levers --smoke                   # seconds: checks the script still runs

Parts: ``compile`` (torch.compile against eager, and the recompiles of a multi-resolution run), ``bf16`` (autocast
against fp32, with the matrix products alone to say where the difference comes from), ``adamw`` (for-loop, foreach
and fused implementations), ``profile`` (the eager step's time by kind of operation and its FLOP/s against the
fp32 matmul peak), ``content`` (``model.content_keep``), ``threads`` (the machine's cores given to one process, or a
single-threaded process per core, all training at once: how a grid of independent runs, such as the resolution study,
should use them). Results: OUT/cpu_levers.json and OUT/cpu_levers.md, written after each part; a part measured again
replaces its rows and keeps the others', each row saying when, on which processor and with which torch it was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

import vitpe
from benchmarks.timing import alternate, cpu_name, flops_per_call, matmul_peak, ratio, step_fn, usable_cores
from vitpe.config import load_config
from vitpe.errors import VitpeError

ROOT = Path(__file__).resolve().parents[1]
_main = load_config(ROOT / "configs" / "shapes.yaml").model
_fm = load_config(ROOT / "configs" / "fashion_mnist_cpu.yaml").model
ARCHS = {  # model arguments; the benchmark's batch is random images of img_size with in_chans channels
    "main": dict(img_size=32, patch_size=_main.patch_size, embed_dim=_main.embed_dim, depth=_main.depth, num_heads=_main.num_heads,
                 mlp_ratio=_main.mlp_ratio, pool=_main.pool),
    "192d": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
    "fmnist": dict(vars(_fm), in_chans=1),  # the Fashion-MNIST CPU recipe's model, its PE included
}
PARTS = ("compile", "bf16", "adamw", "profile", "content", "threads")
CONTENT_KEEPS = (1.0, 0.65, 0.5)  # model.content_keep: the fraction of each image's patches kept, those with the most content
KINDS = {  # profiler op name -> kind of work, first match wins
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"),
    "attention": ("scaled_dot_product",),
    "optimizer": ("_foreach_", "adam", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt"),
    "layer norm": ("layer_norm",),
    "gelu": ("gelu",),
    "patch embedding (conv)": ("convolution",),
    "softmax / loss": ("softmax", "nll_loss", "cross_entropy"),
    "copies and layout": ("copy_", "aten::cat", "aten::stack", "clone", "contiguous", "aten::to", "_to_copy", "permute", "transpose"),
    "elementwise": ("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::sum", "aten::mean", "fill_", "zero_"),
}


def model_and_batch(arch: str, batch: int, smoke: bool, **overrides):
    a = {"pos_embed": "sincos2d", "in_chans": 3, **ARCHS[arch], **overrides, **({"depth": 1} if smoke else {})}
    torch.manual_seed(0)
    model = vitpe.VisionTransformer(**a, num_classes=10)
    return model, torch.randn(batch, a["in_chans"], a["img_size"], a["img_size"]), torch.randint(0, 10, (batch,))


def part_compile(arch: str, args) -> Dict:
    import torch._dynamo as dynamo

    model, x, y = model_and_batch(arch, args.batch, args.smoke)
    compiled = torch.compile(model)
    t0 = time.time()
    step_fn(compiled, x, y)()
    first = time.time() - t0
    times = alternate({"eager": step_fn(model, x, y), "compile": step_fn(compiled, x, y)}, args.iters, args.rounds, torch.device("cpu"))
    r = ratio(times, "eager", "compile")
    explain = dynamo.explain(model)(x)
    # A multi-resolution run: sizes cycled as train.resolutions does; how often does it compile? Static shapes, one graph
    # per size (train.py's setting): with dynamic shapes torch 2.14's inductor fails in backward at the second size
    # (an input stride it specialised), see docs/benchmarks.md.
    dynamo.reset()
    compiled = torch.compile(model, dynamic=False)
    sizes = [16, 24, 32, 40] if not args.smoke else [16, 32]
    before = dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.time()
    for i in range(args.multires_steps):
        s = sizes[i % len(sizes)]
        step_fn(compiled, torch.nn.functional.interpolate(x, size=(s, s)), y)()
    graphs = dynamo.utils.counters["stats"]["unique_graphs"] - before
    return {"part": "compile", "arch": arch, "eager_img_s": args.batch / statistics.median(times["eager"]),
            "compile_img_s": args.batch / statistics.median(times["compile"]), "ratio_compile_over_eager": r["median"],
            "ratio_range": [r["min"], r["max"]], "first_compiled_step_s": first, "graph_breaks": explain.graph_break_count,
            "multires_sizes": sizes, "multires_steps": args.multires_steps, "multires_graphs_compiled": graphs,
            "multires_wall_s": time.time() - t0}


def part_bf16(arch: str, args) -> Dict:
    model, x, y = model_and_batch(arch, args.batch, args.smoke)
    times = alternate({"fp32": step_fn(model, x, y), "bf16": step_fn(model, x, y, torch.bfloat16)}, args.iters, args.rounds,
                      torch.device("cpu"))
    r = ratio(times, "fp32", "bf16")
    n = 256 if args.smoke else 1024
    peaks = {str(d).split(".")[-1]: matmul_peak(torch.device("cpu"), d, n) for d in (torch.float32, torch.bfloat16)}
    # The shapes the model's products have: batch x tokens rows, width columns (the qkv projection).
    m, k = args.batch * (ARCHS[arch]["img_size"] // ARCHS[arch]["patch_size"]) ** 2, ARCHS[arch]["embed_dim"]
    shaped = {}
    for d in (torch.float32, torch.bfloat16):
        a, b = torch.randn(m, k, dtype=d), torch.randn(k, 3 * k, dtype=d)
        shaped[str(d).split(".")[-1]] = alternate({"mm": lambda: a @ b}, 5, 3, torch.device("cpu"))["mm"]
    mm = {name: 2 * m * k * 3 * k / statistics.median(v) for name, v in shaped.items()}
    return {"part": "bf16", "arch": arch, "fp32_img_s": args.batch / statistics.median(times["fp32"]),
            "bf16_img_s": args.batch / statistics.median(times["bf16"]), "ratio_bf16_over_fp32": r["median"],
            "ratio_range": [r["min"], r["max"]], "square_matmul_tflop_s": {k: v / 1e12 for k, v in peaks.items()},
            "qkv_shaped_matmul_tflop_s": {k: v / 1e12 for k, v in mm.items()}, "qkv_shape": [m, k, 3 * k]}


def part_adamw(arch: str, args) -> Dict:
    model, x, y = model_and_batch(arch, args.batch, args.smoke)
    fns = {}
    for impl, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        try:
            fns[impl] = step_fn(model, x, y, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4, **kw))
        except (RuntimeError, TypeError, ValueError) as e:  # an older torch without fused AdamW on CPU
            print(f"[adamw] {impl} unavailable: {e}")
    times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
    return {"part": "adamw", "arch": arch, **{f"{k}_img_s": args.batch / statistics.median(v) for k, v in times.items()},
            **{f"ratio_{k}_over_foreach": ratio(times, "foreach", k)["median"] for k in times if k != "foreach"}}


def part_profile(arch: str, args) -> Dict:
    from torch.profiler import profile

    model, x, y = model_and_batch(arch, args.batch, args.smoke)
    step = step_fn(model, x, y)
    for _ in range(2):
        step()
    flops = flops_per_call(step)
    steps = 2 if args.smoke else 5
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sec = (time.perf_counter() - t0) / steps
    with profile() as prof:
        for _ in range(steps):
            step()
    by_kind: Dict[str, float] = {}
    total = 0.0
    for e in prof.key_averages():
        us = e.self_cpu_time_total
        total += us
        kind = next((k for k, names in KINDS.items() if any(n in e.key for n in names)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    peak = matmul_peak(torch.device("cpu"), torch.float32, 256 if args.smoke else 2048)
    return {"part": "profile", "arch": arch, "step_s": sec, "gflop_per_step": flops / 1e9, "tflop_s": flops / sec / 1e12,
            "fp32_matmul_peak_tflop_s": peak / 1e12, "fraction_of_peak": flops / sec / peak,
            "share_by_kind": {k: v / total for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def part_content(arch: str, args) -> Dict:
    """The training step with model.content_keep against every token, same weights (the cost depends only on how many
    tokens are kept, not on which); and, on real Fashion-MNIST when it is installed, how many patches are background."""
    fns = {}
    for keep in CONTENT_KEEPS:
        model, x, y = model_and_batch(arch, args.batch, args.smoke, content_keep=keep)
        fns[f"keep{keep:g}"] = step_fn(model, x, y)
    times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
    row = {"part": "content", "arch": arch, **{f"{k}_img_s": args.batch / statistics.median(v) for k, v in times.items()},
           **{f"ratio_{k}_over_keep1": ratio(times, "keep1", k)["median"] for k in times if k != "keep1"}}
    try:
        from vitpe.data import load_dataset

        ds = load_dataset("fashion_mnist", None, None, None, (28, 28))
        imgs = ds.split(True, (28, 28))[0][: 256 if args.smoke else 10000].float()
        p = ARCHS["fmnist"]["patch_size"]
        energy = torch.nn.functional.avg_pool2d(imgs, p).flatten(1)  # mean pixel value per patch (background is 0)
        row["fmnist_background_patch_fraction"] = (energy == 0).float().mean().item()
    except VitpeError as e:  # no Fashion-MNIST here: the speed rows stand alone
        print(f"[content] background fraction not measured: {e}")
    return row


def train_for(arch: str, threads: int, seconds: float, batch: int, smoke: bool) -> None:
    """A worker of ``part_threads``: warm up, say ready, wait for the go on stdin, train for ``seconds``, print the
    steps it finished and their wall time as JSON."""
    torch.set_num_threads(threads)
    model, x, y = model_and_batch(arch, batch, smoke)
    step = step_fn(model, x, y)
    for _ in range(2):
        step()
    print("ready", flush=True)
    sys.stdin.readline()
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        steps += 1
    print(json.dumps({"steps": steps, "seconds": time.perf_counter() - t0}), flush=True)


def layout_speed(arch: str, threads: List[int], args) -> float:
    """Training images/s of processes with these thread counts, training at once: each its own Python process (what a
    study running several runs at a time gets), started together once every one has warmed up."""
    env = dict(os.environ)
    procs = []
    for n in threads:  # OMP_NUM_THREADS too: the OpenMP pool is sized when torch loads, before set_num_threads runs
        cmd = [sys.executable, "-m", "benchmarks.cpu_levers", "--worker", arch, str(n), str(args.threads_seconds), str(args.batch), str(int(args.smoke))]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                      env={**env, "OMP_NUM_THREADS": str(n)}))
    done: List[Dict] = []
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise VitpeError(f"a cpu_levers worker failed before training (exit {p.wait()}); its error is printed above")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            if len(done) < len(procs):  # one failed: the others would wait for a go or train on for nothing
                p.kill()
            p.wait()
    return sum(d["steps"] * args.batch / d["seconds"] for d in done)


def part_threads(arch: str, args) -> Dict:
    """One process with a thread per core against one single-threaded process per core, alternated in rounds. A small
    model's step leaves cores idle between and inside its small operations (the main job's reaches 43% of the matmul
    peak, ``profile``); independent runs in separate processes keep each core busy with its own."""
    cores = usable_cores()
    layouts = {"one_process": [cores], "per_core": [1] * cores}
    names = list(layouts)
    speeds: Dict[str, List[float]] = {k: [] for k in layouts}
    for r in range(args.rounds):
        for k in names[r % 2:] + names[: r % 2]:
            speeds[k].append(layout_speed(arch, layouts[k], args))
    r = ratio({k: [1 / v for v in vs] for k, vs in speeds.items()}, "one_process", "per_core")  # seconds per image
    return {"part": "threads", "arch": arch, "cores": cores, "one_process_img_s": statistics.median(speeds["one_process"]),
            "per_core_img_s": statistics.median(speeds["per_core"]), "ratio_per_core_over_one_process": r["median"],
            "ratio_range": [r["min"], r["max"]], "seconds_per_round": args.threads_seconds, "rounds": args.rounds}


def write_markdown(rows: List[Dict], path: Path) -> None:
    lines = ["Each lever on each architecture, with where it was measured; batch 128 unless said.", ""]
    for r in rows:
        head = f"- **{r['part']}**, {r['arch']} ({r['measured']}): "
        if r["part"] == "compile":
            lo, hi = r["ratio_range"]
            lines.append(head + f"compile/eager **{r['ratio_compile_over_eager']:.3f}** ({lo:.2f}-{hi:.2f}), {r['eager_img_s']:.0f} -> "
                         f"{r['compile_img_s']:.0f} img/s; first compiled step {r['first_compiled_step_s']:.0f} s; graph breaks "
                         f"{r['graph_breaks']}; {r['multires_steps']} steps cycling {r['multires_sizes']} px compiled "
                         f"{r['multires_graphs_compiled']} graphs in {r['multires_wall_s']:.0f} s")
        elif r["part"] == "bf16":
            lo, hi = r["ratio_range"]
            sq, qkv = r["square_matmul_tflop_s"], r["qkv_shaped_matmul_tflop_s"]
            lines.append(head + f"bf16/fp32 **{r['ratio_bf16_over_fp32']:.3f}** ({lo:.2f}-{hi:.2f}); square matmul fp32 "
                         f"{sq['float32']:.3f} vs bf16 {sq['bfloat16']:.3f} TFLOP/s; qkv-shaped {r['qkv_shape']} fp32 "
                         f"{qkv['float32']:.3f} vs bf16 {qkv['bfloat16']:.3f} TFLOP/s")
        elif r["part"] == "adamw":
            lines.append(head + ", ".join(f"{k[:-6]} {v:.0f} img/s" for k, v in r.items() if k.endswith("_img_s")) + "; "
                         + ", ".join(f"{k[6:]} **{v:.3f}**" for k, v in r.items() if k.startswith("ratio_")))
        elif r["part"] == "content":
            lines.append(head + ", ".join(f"{k[:-6]} {v:.0f} img/s" for k, v in r.items() if k.endswith("_img_s")) + "; "
                         + ", ".join(f"{k[6:]} **{v:.3f}**" for k, v in r.items() if k.startswith("ratio_"))
                         + (f"; Fashion-MNIST patches that are all background: {100 * r['fmnist_background_patch_fraction']:.1f}%"
                            if "fmnist_background_patch_fraction" in r else ""))
        elif r["part"] == "threads":
            lo, hi = r["ratio_range"]
            lines.append(head + f"one process on {r['cores']} cores {r['one_process_img_s']:.0f} img/s, one single-threaded process per "
                         f"core {r['per_core_img_s']:.0f} img/s in all: per core / one process **{r['ratio_per_core_over_one_process']:.3f}** "
                         f"({lo:.2f}-{hi:.2f}; {r['rounds']} round{'s' * (r['rounds'] != 1)} of {r['seconds_per_round']:g} s each)")
        elif r["part"] == "profile":
            share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["share_by_kind"].items())
            lines.append(head + f"{r['step_s']:.3f} s per step, {r['gflop_per_step']:.1f} GFLOP, {r['tflop_s']:.3f} TFLOP/s = "
                         f"**{100 * r['fraction_of_peak']:.0f}%** of the fp32 matmul peak ({r['fp32_matmul_peak_tflop_s']:.3f}); "
                         f"self time by kind: {share}")
    path.write_text("\n".join(lines) + "\n")


def earlier_rows(path: Path) -> List[Dict]:
    """The rows an earlier run wrote, each stamped with where it was measured (files written before rows carried the
    stamp had one for the whole file)."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    meta = data.get("meta")
    stamp = f"torch {meta['torch']}, {meta['threads']} threads" if meta else "not recorded"
    return [{**r, "measured": r.get("measured", stamp)} for r in data["rows"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    p.add_argument("--iters", type=int, default=3, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--multires-steps", type=int, default=24)
    p.add_argument("--threads-seconds", type=float, default=20.0, help="threads: seconds each layout trains per round")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # ARCH THREADS SECONDS BATCH SMOKE: part_threads' processes
    args = p.parse_args(argv)
    if args.worker:
        arch, threads, seconds, batch, smoke = args.worker
        train_for(arch, int(threads), float(seconds), int(batch), smoke == "1")
        return 0
    if args.smoke:
        args.iters, args.rounds, args.batch, args.multires_steps, args.threads_seconds = 1, 1, 8, 2, 0.5
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = f"{time.strftime('%Y-%m-%d')}, {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    parts: Dict[str, Callable] = {"compile": part_compile, "bf16": part_bf16, "adamw": part_adamw, "profile": part_profile,
                                  "content": part_content, "threads": part_threads}
    rows = earlier_rows(out / "cpu_levers.json")
    for part in args.parts:
        for arch in args.arch:
            row = {**parts[part](arch, args), "measured": measured}
            rows = [r for r in rows if (r["part"], r["arch"]) != (part, arch)] + [row]
            print(json.dumps(row))
            tmp = out / "cpu_levers.json.tmp"  # after each part, whole or not at all
            tmp.write_text(json.dumps({"rows": rows}, indent=1))
            tmp.replace(out / "cpu_levers.json")
            write_markdown(rows, out / "cpu_levers.md")
    print(f"wrote {out / 'cpu_levers.json'} and {out / 'cpu_levers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
