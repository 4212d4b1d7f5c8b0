#!/usr/bin/env python
"""Speed, side by side in one process: vitpe's ViT against timm's, the cost of each PE, achieved FLOP/s.

    python benchmarks/speed.py                 # CPU (and CUDA when present), both architectures
    python benchmarks/speed.py --smoke         # seconds: checks the script still runs

Measurements alternate A B A B so that drift (thermal, other load) hits both sides alike; each number
is the median over rounds. Results: OUT/speed.json and OUT/speed.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vitpe  # noqa: E402
from vitpe.data import load_dataset  # noqa: E402
from vitpe.data.augment import BatchAugment, normalize  # noqa: E402

ARCHS = {
    "cifar (192d, 6 blocks, patch 4, 32px)": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
    "vit-tiny (192d, 12 blocks, patch 16, 224px)": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
}


def timm_vit(a: Dict, num_classes: int) -> torch.nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=a["img_size"], patch_size=a["patch_size"], embed_dim=a["embed_dim"], depth=a["depth"],
                             num_heads=a["num_heads"], mlp_ratio=a["mlp_ratio"], num_classes=num_classes)


def vitpe_vit(a: Dict, num_classes: int, pe: str = "learned") -> torch.nn.Module:
    return vitpe.VisionTransformer(**a, num_classes=num_classes, pos_embed=pe)


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype, train: bool) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = (lambda: torch.autocast(x.device.type, dtype=dtype)) if dtype else contextlib.nullcontext

    def train_step():
        with ctx():
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    @torch.no_grad()
    def infer_step():
        with ctx():
            model(x)

    model.train(train)
    return train_step if train else infer_step


def timed(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def alternate(fns: Dict[str, Callable[[], None]], iters: int, rounds: int, device: torch.device) -> Dict[str, float]:
    """Median seconds per call of each function, measured in turns."""
    for fn in fns.values():  # warm-up (and compilation)
        timed(fn, 2, device)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(timed(fn, iters, device))
    return {k: statistics.median(v) for k, v in times.items()}


def flops_per_call(fn: Callable[[], None]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, 3, device)
    s = min(s, timed(lambda: a @ b, 5, device))
    return 2 * n**3 / s


def bench_device(device: torch.device, args) -> List[Dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else None
    modes = [("eager", False)] + ([("compile", True)] if device.type == "cuda" and not args.smoke else [])
    archs = {k: v for k, v in ARCHS.items() if not args.smoke or v["img_size"] == 32}
    for arch_name, a in archs.items():
        if args.smoke:
            a = dict(a, depth=1, embed_dim=48, num_heads=3)
        batch = args.batch or (128 if a["img_size"] <= 32 else 64)
        if args.smoke:
            batch = 8
        x = torch.randn(batch, 3, a["img_size"], a["img_size"], device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        for mode, compile_ in modes:
            for train in (True, False):
                models = {"timm": timm_vit(a, 10).to(device), "vitpe": vitpe_vit(a, 10).to(device)}
                if compile_:
                    models = {k: torch.compile(m) for k, m in models.items()}
                fns = {k: step_fn(m, x, y, dtype, train) for k, m in models.items()}
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                sec = alternate(fns, args.iters, args.rounds, device)
                row = {"device": str(device), "arch": arch_name, "mode": mode, "step": "train" if train else "inference", "batch": batch,
                       **{f"{k}_img_s": batch / s for k, s in sec.items()}, "ratio_vitpe_over_timm": sec["timm"] / sec["vitpe"]}
                if train:
                    flops = flops_per_call(fns["vitpe"])
                    row["vitpe_tflop_s"] = flops / sec["vitpe"] / 1e12
                rows.append(row)
                print(json.dumps(row))
        # The cost of each PE: training throughput relative to "none", same architecture, alternated.
        pes = vitpe.list_pos_embeds() + ["sincos2d+rope_mixed"]
        fns = {pe: step_fn(vitpe_vit(a, 10, pe).to(device), x, y, dtype, True) for pe in pes}
        sec = alternate(fns, args.iters, args.rounds, device)
        for pe in pes:
            row = {"device": str(device), "arch": arch_name, "mode": "eager", "step": "train (PE cost)", "pe": pe,
                   "img_s": batch / sec[pe], "ratio_over_none": sec["none"] / sec[pe]}
            rows.append(row)
            print(json.dumps(row))
    peak = matmul_peak(device, torch.bfloat16 if device.type == "cuda" else torch.float32, 512 if args.smoke else (8192 if device.type == "cuda" else 2048))
    rows.append({"device": str(device), "step": "matmul peak", "tflop_s": peak / 1e12,
                 "dtype": "bf16" if device.type == "cuda" else "fp32"})
    print(json.dumps(rows[-1]))
    return rows


def bench_data(args) -> Dict:
    """End-to-end training step (index the in-memory split, augment, normalise) against the model-only step."""
    a = dict(ARCHS["cifar (192d, 6 blocks, patch 4, 32px)"])
    if args.smoke:
        a = dict(a, depth=1, embed_dim=48)
    ds = load_dataset("shapes", train_size=512 if args.smoke else 4096, test_size=64)
    images, labels = ds.split(True)
    batch = 8 if args.smoke else 128
    model = vitpe_vit(a, 10, "sincos2d").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    aug = BatchAugment("crop_flip")

    def train_on(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    x0, y0 = normalize(images[:batch], ds.mean, ds.std), labels[:batch]

    def end_to_end():
        idx = torch.randint(len(labels), (batch,))
        train_on(normalize(aug(images[idx]), ds.mean, ds.std), labels[idx])

    sec = alternate({"model_only": lambda: train_on(x0, y0), "end_to_end": end_to_end}, args.iters, args.rounds, torch.device("cpu"))
    row = {"device": "cpu", "step": "data loading", "model_only_img_s": batch / sec["model_only"], "end_to_end_img_s": batch / sec["end_to_end"],
           "ratio_end_to_end_over_model_only": sec["model_only"] / sec["end_to_end"]}
    print(json.dumps(row))
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.iters, args.rounds = 1, 1
    torch.manual_seed(0)
    rows = bench_device(torch.device("cpu"), args)
    if torch.cuda.is_available():
        rows += bench_device(torch.device("cuda"), args)
    rows.append(bench_data(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    (out / "speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'speed.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
