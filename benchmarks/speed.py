#!/usr/bin/env python
"""Speed, side by side in one process: vitpe's ViT against timm's, the cost of each PE, achieved FLOP/s.

    python -m benchmarks.speed                 # CPU (and CUDA when present), both architectures
    python -m benchmarks.speed --smoke         # seconds: checks the script still runs
    python -m benchmarks.speed --part pe-cost --arch cifar   # only each PE against none (pe_cost.json/.md)
    python -m benchmarks.speed --part bias-mask              # a bias as a 3-D or a 4-D SDPA mask (bias_mask.json/.md)

Measurements alternate A B A B so that drift (thermal, other load) hits both sides alike; each number
is the median over rounds. Results: OUT/speed.json and OUT/speed.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import vitpe
import vitpe.vit
from benchmarks.studykit import SDPA, sdpa_override
from benchmarks.timing import alternate, flops_per_call, matmul_peak, ratio, step_fn
from vitpe.config import load_config
from vitpe.data import load_dataset
from vitpe.data.augment import BatchAugment, normalize

ROOT = Path(__file__).resolve().parents[1]

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


def peak_memory_mib(fn: Callable[[], None], device: torch.device) -> float:
    """Peak tensor memory of one call, in MiB: the CUDA allocator's peak, or on CPU the running sum of the
    profiler's allocation and free events."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak / 2**20


def arch_setup(a: Dict, device: torch.device, args):
    """The architecture (shrunk for --smoke), its batch and a batch of inputs."""
    if args.smoke:
        a = dict(a, depth=1, embed_dim=48, num_heads=3)
    batch = 8 if args.smoke else args.batch or (128 if a["img_size"] <= 32 else 64)
    x = torch.randn(batch, 3, a["img_size"], a["img_size"], device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return a, batch, x, y


def selected_archs(args) -> Dict[str, Dict]:
    archs = {k: v for k, v in ARCHS.items() if not args.smoke or v["img_size"] == 32}
    return {k: v for k, v in archs.items() if args.arch is None or k.startswith(args.arch)}


def bench_pe_cost(device: torch.device, arch_name: str, a: Dict, args) -> List[Dict]:
    """The cost of each PE: training throughput relative to "none", same architecture, alternated."""
    a, batch, x, y = arch_setup(a, device, args)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    pes = vitpe.list_pos_embeds() + ["sincos2d+rope_mixed"]
    fns = {pe: step_fn(vitpe_vit(a, 10, pe).to(device), x, y, dtype, True) for pe in pes}
    times = alternate(fns, args.iters, args.rounds, device)
    rows = []
    for pe in pes:
        r = ratio(times, "none", pe)
        rows.append({"device": str(device), "arch": arch_name, "mode": "eager", "step": "train (PE cost)", "pe": pe,
                     "img_s": batch / statistics.median(times[pe]), "ratio_over_none": r["median"], "ratio_range": [r["min"], r["max"]],
                     "rounds": args.rounds})
        print(json.dumps(rows[-1]))
    return rows


def bias_mask_as_3d() -> contextlib.AbstractContextManager:
    """Inside, a shared grid's bias reaches SDPA as ``(heads, T, T)`` instead of ``(1, heads, T, T)``: the layout vitpe
    gave it before 2026-11-25, kept here as the other side of the comparison."""
    def as_3d(q, k, v, attn_mask=None, **kwargs):
        if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[0] == 1:
            attn_mask = attn_mask[0]
        return SDPA(q, k, v, attn_mask=attn_mask, **kwargs)

    return sdpa_override(as_3d)


def bench_bias_mask(device: torch.device, args) -> List[Dict]:
    """The same additive bias given to SDPA as a 3-D and as a 4-D mask, alternated: SDPA alone (forward + backward) at
    the token counts of 1x, 2x and 4x the study's training size, then the study's model (configs/study_shapes.yaml)
    with each bias PE, inference at those sizes and a training step at 1x."""
    a = dict(vars(load_config(str(ROOT / "configs" / "study_shapes.yaml")).model))
    if args.smoke:
        a["depth"] = 1
    sizes = [a["img_size"] * s for s in ((1,) if args.smoke else (1, 2, 4))]
    heads, head_dim = a["num_heads"], a["embed_dim"] // a["num_heads"]
    rows = []

    def measure(what: str, pe: str, px: int, run: Callable[[int, int], Dict[str, Callable[[], None]]]) -> None:
        """Times ``run(tokens, batch)``'s "3d" and "4d" functions at ``px`` (a batch of about 8,192 tokens) into a row."""
        tokens = (px // a["patch_size"]) ** 2
        batch = 8 if args.smoke else max(8, 128 * 64 // tokens)
        times = alternate(run(tokens, batch), args.iters, args.rounds, device)
        r = ratio(times, "3d", "4d")
        rows.append({"device": str(device), "what": what, "pe": pe, "px": px, "tokens": tokens, "batch": batch,
                     "img_s_3d": batch / statistics.median(times["3d"]), "img_s_4d": batch / statistics.median(times["4d"]),
                     "speedup": r["median"], "speedup_range": [r["min"], r["max"]], "rounds": args.rounds})
        print(json.dumps(rows[-1]))

    def sdpa_alone(tokens: int, batch: int) -> Dict[str, Callable[[], None]]:
        q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device, requires_grad=True) for _ in range(3))
        bias = torch.randn(heads, tokens, tokens, device=device)
        return {layout: (lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward())
                for layout, mask in (("3d", bias), ("4d", bias[None]))}

    for px in sizes:
        measure("SDPA forward + backward", "-", px, sdpa_alone)
    for pe in [n for n in vitpe.list_pos_embeds() if vitpe.pos_embed_info(n)["biased"]]:  # every bias family, as registered
        model = vitpe.VisionTransformer(**dict(a, pos_embed=pe), num_classes=10).to(device)
        for px, train in [(sizes[0], True)] + [(px, False) for px in sizes]:
            def model_step(tokens: int, batch: int, px=px, train=train) -> Dict[str, Callable[[], None]]:
                x = torch.randn(batch, 3, px, px, device=device)
                step = step_fn(model, x, torch.randint(0, 10, (batch,), device=device), None, train)

                def old():
                    with bias_mask_as_3d():
                        step()

                return {"3d": old, "4d": step}

            measure("training step" if train else "inference", pe, px, model_step)
    return rows


def bench_device(device: torch.device, args) -> List[Dict]:
    rows = []
    dtype = torch.bfloat16 if device.type == "cuda" else None
    modes = [("eager", False)] + ([("compile", True)] if device.type == "cuda" and not args.smoke else [])
    for arch_name, a0 in selected_archs(args).items():
        a, batch, x, y = arch_setup(a0, device, args)
        for mode, compile_ in modes:
            for train in (True, False):
                models = {"timm": timm_vit(a, 10).to(device), "vitpe": vitpe_vit(a, 10).to(device)}
                if compile_:
                    models = {k: torch.compile(m) for k, m in models.items()}
                fns = {k: step_fn(m, x, y, dtype, train) for k, m in models.items()}
                times = alternate(fns, args.iters, args.rounds, device)
                sec = {k: statistics.median(v) for k, v in times.items()}
                r = ratio(times, "timm", "vitpe")
                row = {"device": str(device), "arch": arch_name, "mode": mode, "step": "train" if train else "inference", "batch": batch,
                       **{f"{k}_img_s": batch / s for k, s in sec.items()}, "ratio_vitpe_over_timm": r["median"],
                       "ratio_range": [r["min"], r["max"]], "rounds": args.rounds,
                       **{f"{k}_peak_mib": peak_memory_mib(fn, device) for k, fn in fns.items()}}
                if train:  # achieved FLOP/s of each side's own step (vitpe skips work the head does not read)
                    for k in fns:
                        row[f"{k}_gflop_per_step"] = flops_per_call(fns[k]) / 1e9
                        row[f"{k}_tflop_s"] = row[f"{k}_gflop_per_step"] / sec[k] / 1e3
                rows.append(row)
                print(json.dumps(row))
        rows += bench_pe_cost(device, arch_name, a0, args)
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

    times = alternate({"model_only": lambda: train_on(x0, y0), "end_to_end": end_to_end}, args.iters, args.rounds, torch.device("cpu"))
    r = ratio(times, "model_only", "end_to_end")
    row = {"device": "cpu", "step": "data loading", "model_only_img_s": batch / statistics.median(times["model_only"]),
           "end_to_end_img_s": batch / statistics.median(times["end_to_end"]), "ratio_end_to_end_over_model_only": r["median"],
           "ratio_range": [r["min"], r["max"]], "rounds": args.rounds}
    print(json.dumps(row))
    return row


def write_markdown(rows: List[Dict], meta: Dict, path: Path) -> None:
    """The tables of docs/benchmarks.md, from speed.json's rows."""
    peak = {r["device"]: r["tflop_s"] for r in rows if r.get("step") == "matmul peak"}
    lines = [f"torch {meta['torch']}, {meta['threads']} threads" + (f", {meta['cuda']}" if meta["cuda"] else ""), ""]
    if any("ratio_vitpe_over_timm" in r for r in rows):
        lines += ["| device | architecture | mode | step | batch | timm img/s | vitpe img/s | vitpe/timm (range) | peak MiB timm / vitpe "
                  "| GFLOP per step timm / vitpe | TFLOP/s timm / vitpe (% of matmul peak) |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "ratio_vitpe_over_timm" in r:
            lo, hi = r["ratio_range"]
            gflop, flop = "-", "-"
            if "vitpe_tflop_s" in r:
                gflop = f"{r['timm_gflop_per_step']:.1f} / {r['vitpe_gflop_per_step']:.1f}"
                flop = " / ".join(f"{r[f'{k}_tflop_s']:.3f} ({100 * r[f'{k}_tflop_s'] / peak[r['device']]:.0f}%)" for k in ("timm", "vitpe"))
            lines.append(f"| {r['device']} | {r['arch']} | {r['mode']} | {r['step']} | {r['batch']} | {r['timm_img_s']:.1f} | {r['vitpe_img_s']:.1f} "
                         f"| **{r['ratio_vitpe_over_timm']:.3f}** ({lo:.2f}-{hi:.2f}) | {r['timm_peak_mib']:.0f} / {r['vitpe_peak_mib']:.0f} "
                         f"| {gflop} | {flop} |")
    if lines[-1]:
        lines.append("")
    if any("speedup" in r for r in rows):
        lines += ["| device | what | PE | px (tokens) | batch | 3-D mask img/s | 4-D mask img/s | 4-D over 3-D (range) |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lo, hi = r["speedup_range"]
            lines.append(f"| {r['device']} | {r['what']} | {r['pe']} | {r['px']} ({r['tokens']}) | {r['batch']} | {r['img_s_3d']:.1f} "
                         f"| {r['img_s_4d']:.1f} | **{r['speedup']:.2f}** ({lo:.2f}-{hi:.2f}) |")
        path.write_text("\n".join(lines) + "\n")
        return
    lines += ["| device | architecture | PE | training img/s | over `none` (range) |", "| --- | --- | --- | ---: | ---: |"]
    for r in rows:
        if r["step"] == "train (PE cost)":
            lo, hi = r["ratio_range"]
            lines.append(f"| {r['device']} | {r['arch']} | {r['pe']} | {r['img_s']:.1f} | **{r['ratio_over_none']:.3f}** ({lo:.2f}-{hi:.2f}) |")
    lines += [""]
    for r in rows:
        if r["step"] == "matmul peak":
            lines.append(f"- matmul peak on {r['device']} ({r['dtype']}): {r['tflop_s']:.3f} TFLOP/s")
        if r["step"] == "data loading":
            lo, hi = r["ratio_range"]
            lines.append(f"- data loading (CPU, crop+flip from the in-memory split): end-to-end {r['end_to_end_img_s']:.1f} img/s against "
                         f"model-only {r['model_only_img_s']:.1f} img/s: **{r['ratio_end_to_end_over_model_only']:.3f}** ({lo:.2f}-{hi:.2f})")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--part", choices=["all", "pe-cost", "bias-mask"], default="all",
                   help="pe-cost: only each PE's training throughput against none (writes pe_cost.json/.md); bias-mask: "
                        "a bias PE's mask given to SDPA in 3-D against 4-D (bias_mask.json/.md)")
    p.add_argument("--arch", help="only the architectures whose name starts with this (e.g. cifar)")
    args = p.parse_args(argv)
    if args.smoke:
        args.iters, args.rounds = 1, 1
    torch.manual_seed(0)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    if args.part == "bias-mask":
        rows, name = [row for d in devices for row in bench_bias_mask(d, args)], "bias_mask"
    elif args.part == "pe-cost":
        rows, name = [row for d in devices for k, a in selected_archs(args).items() for row in bench_pe_cost(d, k, a, args)], "pe_cost"
    else:
        rows, name = [row for d in devices for row in bench_device(d, args)] + [bench_data(args)], "speed"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_markdown(rows, meta, out / f"{name}.md")
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
