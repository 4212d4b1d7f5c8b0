#!/usr/bin/env python
"""Coordinates per image, measured: the shared-grid fast path against an earlier revision, token dropping, packing.

    python -m benchmarks.per_image --parts baseline --baseline 12a28ff   # main-job training throughput, this tree / REV
    python -m benchmarks.per_image --parts token_keep packing            # speed, side by side in one process
    python -m benchmarks.per_image --parts accuracy --seeds 0 1          # Fashion-MNIST at equal wall time, r = 1 vs 0.5
    python -m benchmarks.per_image --parts coord_aug                     # the study's coordinate augmentation: its cost
    python -m benchmarks.per_image --parts baseline --baseline REV --with-coord-aug --pes fire   # ... this tree / REV
    python -m benchmarks.per_image --parts lattice                       # bias families on packed rows: lattice / every pair
    python -m benchmarks.per_image --smoke                               # seconds: checks the script still runs

``baseline`` imports REV's vitpe (a git worktree) beside this tree's and alternates their training steps in one
process, A B A B, reporting the median of the per-round ratios. ``token_keep`` and ``packing`` alternate in one process
(benchmarks/timing.py). ``lattice`` alternates packed training steps of the bias families with their per-image lattice path
and with it switched off (every pair evaluated), with a second lattice copy as the control. ``coord_aug`` alternates
training steps of the main job's model without a PE, with PE P, and with P and the resolution-transfer study's
per-image coordinate augmentation (its ``AUG``). ``accuracy`` trains
configs/fashion_mnist_cpu.yaml with every token for E epochs and with half the tokens for E x (measured speed-up)
epochs, so both take the same wall time. Results go to OUT/per_image.json
(merged part by part as each finishes) and OUT/per_image.md.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
import yaml

import vitpe
from benchmarks.studykit import TrainSpec, train_or_reuse
from benchmarks.timing import alternate, flops_per_call, ratio
from vitpe.checkpoint import load_checkpoint
from vitpe.config import ModelConfig, load_config
from vitpe.data import load_dataset
from vitpe.data.augment import normalize
from vitpe.data.mixed import draw_sizes, mixed_batch
from vitpe.runs import safe_name

ROOT = Path(__file__).resolve().parents[1]
# The models measured, as VisionTransformer arguments (their configs' model sections): the main job (python train.py),
# the 192-d architecture of benchmarks/speed.py (ModelConfig's defaults), and the Fashion-MNIST CPU recipe.
ARCHS = {
    "main job (96-d, 4 blocks, 32 px)": vars(load_config(str(ROOT / "configs" / "shapes.yaml")).model),
    "192-d (6 blocks, 32 px)": vars(ModelConfig()),
    "fashion_mnist_cpu (96-d, 4 blocks, 28 px)": vars(load_config(str(ROOT / "configs" / "fashion_mnist_cpu.yaml")).model),
}
MAIN_JOB, BENCH_192, FMNIST_CPU = ARCHS

def merge(out: Path, part: str, rows: List[Dict]) -> None:
    """Write one part's rows into OUT/per_image.json (other parts kept) and re-render the markdown table."""
    path = out / "per_image.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[part] = rows
    data["_meta"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": os.cpu_count(),
                     "date": time.strftime("%Y-%m-%d %H:%M")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    lines = [f"Measured {data['_meta']['date']}, torch {data['_meta']['torch']}, {data['_meta']['threads']} threads.", ""]
    for name, part_rows in data.items():
        if name.startswith("_") or not part_rows:
            continue
        keys = list(part_rows[0])
        lines += [f"### {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |" for r in part_rows] + [""]
    (out / "per_image.md").write_text("\n".join(lines))


def load_baseline(rev: str):
    """vitpe as of git revision ``rev``, imported beside this tree's as package ``vitpe_base`` (a git worktree), so both
    run in one process and are timed in turns. Its model code uses relative imports only, so nothing of it mixes."""
    tree = Path(tempfile.gettempdir()) / f"vitpe-baseline-{safe_name(rev)}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    spec = importlib.util.spec_from_file_location("vitpe_base", tree / "vitpe" / "__init__.py", submodule_search_locations=[str(tree / "vitpe")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["vitpe_base"] = module
    warnings.filterwarnings("ignore", message="Overwriting vitpe_")  # two vitpes register the same timm model names
    spec.loader.exec_module(module)
    return module


def recipe_step(package, arch: str, pe: str, **model_kwargs) -> Callable[[], None]:
    """One training step as train.py takes it (batch 128, timm's AdamW, label smoothing, gradient clipping) of
    architecture ``arch`` with PE ``pe`` (and ``model_kwargs``), built by ``package``'s VisionTransformer."""
    from timm.optim import create_optimizer_v2

    torch.manual_seed(0)
    model = package.VisionTransformer(**{**ARCHS[arch], "pos_embed": pe, **model_kwargs}, num_classes=10, in_chans=3)
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    x, y = torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))

    def step():
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def part_baseline(args) -> List[Dict]:
    """This tree's training throughput over REV's, in one process, alternating A B A B (the main job's model, and with
    other PEs)."""
    base = load_baseline(args.baseline)
    rows = []
    arch = MAIN_JOB
    kw = {"coord_aug": study_coord_aug()} if args.with_coord_aug else {}
    for pe in args.pes:
        # A second copy of this tree's model is the control: its ratio to the first is what the harness alone shows.
        fns = {"this tree": recipe_step(vitpe, arch, pe, **kw), "baseline": recipe_step(base, arch, pe, **kw),
               "this tree again": recipe_step(vitpe, arch, pe, **kw)}
        times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
        r, control = ratio(times, "baseline", "this tree"), ratio(times, "this tree again", "this tree")
        rows.append({"arch": arch, "pe": pe, "this_img_s": 128 / statistics.median(times["this tree"]),
                     "baseline_img_s": 128 / statistics.median(times["baseline"]),
                     "throughput_ratio": r["median"], "ratio_min": r["min"], "ratio_max": r["max"],
                     "fastest_round_ratio": min(times["baseline"]) / min(times["this tree"]), "control_ratio": control["median"],
                     "control_min": control["min"], "control_max": control["max"], "rounds": args.rounds, "steps_per_round": args.iters,
                     "baseline": args.baseline, "coord_aug": bool(kw)})
        print(f"[baseline] {pe}: this tree / {args.baseline} = {r['median']:.3f} (rounds {r['min']:.3f}..{r['max']:.3f}; fastest rounds "
              f"{rows[-1]['fastest_round_ratio']:.3f}); control, this tree / itself = {control['median']:.3f}")
    return rows


@functools.lru_cache(maxsize=None)
def study():
    """The resolution-transfer study's module (loaded once): its ``FAMILY:aug`` rows and their coordinate augmentation
    live there."""
    spec = importlib.util.spec_from_file_location("resolution_transfer", ROOT / "benchmarks" / "resolution_transfer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def study_coord_aug() -> Dict[str, float]:
    """The coordinate augmentation of the resolution-transfer study's ``FAMILY:aug`` rows."""
    return yaml.safe_load(study().AUG)


def study_aug_pes() -> List[str]:
    """The families the study trains with coordinate augmentation (every one that reads coordinates), each timed with a
    draw per image: for the study's PER_BATCH_ONLY families, whose rows draw per batch, this cost is the reason."""
    return list(dict.fromkeys(pe for pe, variant in map(study().parse_row, study().all_rows()) if variant in study().COORD_AUG))


def part_coord_aug(args) -> List[Dict]:
    """Training throughput of the study's augmented rows: the main job's model without a PE, with the PE, with the PE
    and the study's per-image coordinate augmentation, and, for a family whose study row draws once per batch
    (``FAMILY:augbatch``), with that draw too, alternated in one process (train.py's step, batch 128)."""
    aug, batch_aug, arch, rows = study_coord_aug(), yaml.safe_load(study().COORD_AUG["augbatch"]), MAIN_JOB, []
    for pe in args.aug_pes or study_aug_pes():
        fns = {"none": recipe_step(vitpe, arch, "none"), pe: recipe_step(vitpe, arch, pe),
               "coord_aug": recipe_step(vitpe, arch, pe, coord_aug=aug)}
        per_batch = study().in_grid(pe, "augbatch")
        if per_batch:
            fns["per batch"] = recipe_step(vitpe, arch, pe, coord_aug=batch_aug)
        times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
        plain, augmented, aug_plain = ratio(times, "none", pe), ratio(times, "none", "coord_aug"), ratio(times, pe, "coord_aug")
        batch = ratio(times, pe, "per batch") if per_batch else {}
        rows.append({"arch": arch, "pe": pe, "coord_aug": json.dumps(aug), "none_img_s": 128 / statistics.median(times["none"]),
                     "pe_img_s": 128 / statistics.median(times[pe]), "aug_img_s": 128 / statistics.median(times["coord_aug"]),
                     "pe_over_none": plain["median"], "aug_over_none": augmented["median"], "aug_over_none_min": augmented["min"],
                     "aug_over_none_max": augmented["max"], "aug_over_pe": aug_plain["median"], "aug_over_pe_min": aug_plain["min"],
                     "aug_over_pe_max": aug_plain["max"], "per_batch_over_pe": batch.get("median"), "per_batch_over_pe_min": batch.get("min"),
                     "per_batch_over_pe_max": batch.get("max"), "rounds": args.rounds, "steps_per_round": args.iters})
        print(f"[coord_aug] {pe}: {rows[-1]['aug_img_s']:.0f} img/s with coord_aug, {augmented['median']:.3f} of none's speed "
              f"(rounds {augmented['min']:.3f}..{augmented['max']:.3f}), {aug_plain['median']:.3f} of {pe}'s without it"
              + (f"; drawn per batch {batch['median']:.3f} of {pe}'s (rounds {batch['min']:.3f}..{batch['max']:.3f})" if batch else ""))
    return rows


def train_step(model: torch.nn.Module, make: Callable[[], tuple]) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step():
        x, y, kw = make()
        loss = F.cross_entropy(model(x, **kw), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def part_token_keep(args) -> List[Dict]:
    """Training steps at token_keep 1, 0.5, 0.25, alternated in one process, for the main job and the CPU recipe."""
    rows = []
    for arch, a in ARCHS.items():
        torch.manual_seed(0)
        chans = 1 if a["img_size"] == 28 else 3
        model = vitpe.VisionTransformer(**a, in_chans=chans, num_classes=10)
        x, y = torch.randn(128, chans, a["img_size"], a["img_size"]), torch.randint(0, 10, (128,))
        fns = {k: train_step(model, lambda k=k: (x, y, {} if k == 1.0 else {"token_keep": k})) for k in args.keeps}
        times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
        for k in args.keeps:
            r = ratio(times, 1.0, k)
            rows.append({"arch": arch, "token_keep": k, "img_s": 128 / statistics.median(times[k]), "speedup": r["median"],
                         "speedup_min": r["min"], "speedup_max": r["max"], "ideal": 1 / k})
            print(f"[token_keep] {arch} r={k}: {rows[-1]['img_s']:.0f} img/s, {r['median']:.2f}x (ideal {1 / k:.1f}x)")
    return rows


# (name, sides drawn per axis, row length): the first setup's attention runs over 144-token rows where a 32x32 image
# has 64 tokens; the second keeps rows as long as a same-size image (but 49-token images leave 15-token gaps that no
# image fills); the third gives the same images rows twice as long, which fill better.
PACKING_SETUPS = [("16-48 px, rows of 144 tokens", list(range(16, 49, 4)), 144), ("16-32 px, rows of 64 tokens", list(range(16, 33, 4)), 64),
                  ("16-32 px, rows of 128 tokens", list(range(16, 33, 4)), 128)]


def part_packing(args) -> List[Dict]:
    """Tokens/s of packed mixed-size training steps against same-size batches of the same token count (the model's
    step; data built beforehand), the FLOPs behind both, and the cost of building each batch (shapes rendered at each
    image's size)."""
    ds = load_dataset("shapes", train_size=2048, test_size=64)
    arch = BENCH_192
    p, side = ARCHS[arch]["patch_size"], ARCHS[arch]["img_size"]
    same_n = 64  # 64 images x 64 tokens = 4096 patch tokens per step
    same_tokens = same_n * (side // p) ** 2
    same = normalize(ds.images_at(True, torch.arange(same_n), (side, side)), ds.mean, ds.std)
    labels = ds.split(True)[1]
    rows = []
    for setup, sides, budget in PACKING_SETUPS:
        torch.manual_seed(0)
        sizes = draw_sizes(4 * same_n, sides, p)
        count = tokens = 0
        while tokens + sizes[count][0] * sizes[count][1] // p**2 <= same_tokens:  # as many images as fill the same tokens
            tokens += sizes[count][0] * sizes[count][1] // p**2
            count += 1
        packed = mixed_batch(ds, True, torch.arange(count), sizes[:count], p, budget)
        for pe in args.pes:
            torch.manual_seed(0)
            model = vitpe.VisionTransformer(**{**ARCHS[arch], "pos_embed": pe}, num_classes=10)
            fns = {"same size": train_step(model, lambda: (same, labels[:same_n], {})),
                   "packed": train_step(model, lambda: (packed, labels[:count], {}))}
            flops = {k: flops_per_call(fn) for k, fn in fns.items()}
            times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
            same_tok, packed_tok = same_tokens / statistics.median(times["same size"]), packed.num_tokens / statistics.median(times["packed"])
            rows.append({"arch": arch, "setup": setup, "pe": pe, "same_size_tokens_s": same_tok, "packed_tokens_s": packed_tok, "ratio": packed_tok / same_tok,
                         "flops_per_token_ratio": (flops["packed"] / packed.num_tokens) / (flops["same size"] / same_tokens),
                         "images_packed": count, "rows": packed.patches.shape[0], "fill": packed.num_tokens / packed.patches.shape[:2].numel()})
            print(f"[packing] {setup}, {pe}: packed {packed_tok:.0f} tokens/s vs same size {same_tok:.0f} = {rows[-1]['ratio']:.3f} "
                  f"(FLOPs per token {rows[-1]['flops_per_token_ratio']:.2f}x)")
        data = {"same size": lambda: normalize(ds.images_at(True, torch.arange(same_n), (side, side)), ds.mean, ds.std),
                "packed": lambda: mixed_batch(ds, True, torch.arange(count), sizes[:count], p, budget)}
        dt = alternate(data, args.iters, args.rounds, torch.device("cpu"))
        rows.append({"arch": arch, "setup": setup, "pe": "(data: ms to build one batch)", "same_size_tokens_s": 1000 * statistics.median(dt["same size"]),
                     "packed_tokens_s": 1000 * statistics.median(dt["packed"]), "ratio": float("nan"), "flops_per_token_ratio": float("nan"),
                     "images_packed": count, "rows": packed.patches.shape[0], "fill": packed.num_tokens / packed.patches.shape[:2].numel()})
    return rows


def part_lattice(args) -> List[Dict]:
    """Packed mixed-size training steps (the first packing setup, each image with the study's coordinate augmentation)
    of each bias family on its per-image lattice path against the same steps evaluating every pair, in one process."""
    import vitpe.pos_embed.bias as bias_module

    ds = load_dataset("shapes", train_size=2048, test_size=64)
    arch, (setup, sides, budget) = BENCH_192, PACKING_SETUPS[0]
    p = ARCHS[arch]["patch_size"]
    torch.manual_seed(0)
    sizes = draw_sizes(64, sides, p)
    packed = mixed_batch(ds, True, torch.arange(64), sizes, p, budget)
    labels = ds.split(True)[1][:64]
    lattice = bias_module._row_lattices

    def every_pair(step: Callable[[], None]) -> Callable[[], None]:
        def run():
            bias_module._row_lattices = lambda grid: None
            try:
                step()
            finally:
                bias_module._row_lattices = lattice
        return run

    rows = []
    for pe in args.lattice_pes:
        steps = []
        for _ in range(3):
            torch.manual_seed(0)
            model = vitpe.VisionTransformer(**{**ARCHS[arch], "pos_embed": pe, "coord_aug": study_coord_aug()}, num_classes=10)
            steps.append(train_step(model, lambda: (packed, labels, {})))
        assert lattice(vitpe.CoordAugment(**study_coord_aug())(packed.grid)) is not None  # the lattice side takes it
        fns = {"lattice": steps[0], "every pair": every_pair(steps[1]), "lattice again": steps[2]}
        times = alternate(fns, args.iters, args.rounds, torch.device("cpu"))
        r, control = ratio(times, "every pair", "lattice"), ratio(times, "lattice again", "lattice")
        rows.append({"arch": arch, "setup": setup, "pe": pe, "images": 64, "rows": packed.patches.shape[0],
                     "images_per_row": packed.grid.images_per_row, "lattice_img_s": 64 / statistics.median(times["lattice"]),
                     "every_pair_img_s": 64 / statistics.median(times["every pair"]), "speedup": r["median"], "speedup_min": r["min"],
                     "speedup_max": r["max"], "control": control["median"], "rounds": args.rounds, "steps_per_round": args.iters})
        print(f"[lattice] {pe}, {setup}: {rows[-1]['lattice_img_s']:.0f} img/s on lattices, {rows[-1]['every_pair_img_s']:.0f} at every "
              f"pair: {r['median']:.2f}x (rounds {r['min']:.2f}..{r['max']:.2f}); control {control['median']:.3f}")
    return rows


def part_accuracy(args, speedup: float) -> List[Dict]:
    """Fashion-MNIST (real, full test set, last epoch) at equal wall time: every token for E epochs, half for E x speed-up."""
    out = Path(args.out) / "runs"
    rows = []
    plans = [(1.0, args.epochs), (0.5, max(1, round(args.epochs * speedup)))]
    for seed in args.seeds:
        for keep, epochs in plans:
            name = safe_name(f"fmnist-cpu-keep{keep:g}-e{epochs}-seed{seed}")
            cmd = TrainSpec(str(ROOT / "configs" / "fashion_mnist_cpu.yaml"), ("train.budget_min=null", f"train.epochs={epochs}",
                                                                               f"train.token_keep={keep}", f"train.seed={seed}"))
            if args.smoke:
                cmd = cmd.plus("data.train_size=512", "data.test_size=256")
            run = train_or_reuse(out / name, cmd, name)
            metrics = load_checkpoint(run)["metrics"]
            rows.append({"token_keep": keep, "epochs": epochs, "seed": seed, "test_top1": metrics[-1]["test_top1"],
                         "train_wall_s": sum(m["epoch_s"] for m in metrics), "run": name})
            print(f"[accuracy] keep {keep:g}, {epochs} epochs, seed {seed}: {100 * rows[-1]['test_top1']:.2f}% in "
                  f"{rows[-1]['train_wall_s'] / 60:.1f} min")
            merge(Path(args.out), "accuracy", rows)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["token_keep", "packing", "accuracy"],
                   choices=["baseline", "token_keep", "packing", "accuracy", "coord_aug", "lattice"])
    p.add_argument("--baseline", default="HEAD", help="git revision to compare the main job's throughput with")
    p.add_argument("--with-coord-aug", action="store_true",
                   help="baseline: both sides train with the study's coordinate augmentation (results: part baseline_coord_aug)")
    p.add_argument("--pes", nargs="+", default=["sincos2d", "rope_mixed", "rel_bias"])
    p.add_argument("--aug-pes", nargs="+", help="coord_aug: the PEs measured (default: the families of the study's augmented rows)")
    p.add_argument("--lattice-pes", nargs="+", default=[n for n in vitpe.list_pos_embeds() if vitpe.pos_embed_info(n)["biased"]],
                   help="lattice: the bias families measured (default: every one registered)")
    p.add_argument("--keeps", nargs="+", type=float, default=[1.0, 0.5, 0.25])
    p.add_argument("--iters", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=4, help="accuracy: epochs with every token")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--smoke", action="store_true", help="tiny settings: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.iters, args.rounds, args.pes, args.keeps, args.epochs = 1, 1, ["rope_mixed"], [1.0, 0.5], 1
        args.aug_pes = [study().PER_BATCH_CONTROL]  # a family the study also trains with a draw per batch: both timed
        args.lattice_pes = ["fire"]
        for a in ARCHS.values():
            a.update(embed_dim=24, depth=1, num_heads=2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    speedup = 2.0
    for part in args.parts:
        if part == "accuracy":
            done = json.loads((out / "per_image.json").read_text()).get("token_keep", []) if (out / "per_image.json").is_file() else []
            measured = [r["speedup"] for r in done if r["token_keep"] == 0.5 and r["arch"].startswith("fashion_mnist_cpu")]
            speedup = measured[0] if measured else speedup
            print(f"[accuracy] half the tokens trains {speedup:.2f}x faster (token_keep part{'' if measured else ': not run, assumed'})")
            part_accuracy(args, speedup)
        else:
            parts = {"baseline": part_baseline, "token_keep": part_token_keep, "packing": part_packing, "coord_aug": part_coord_aug,
                     "lattice": part_lattice}
            rows = parts[part](args)
            merge(out, "baseline_coord_aug" if part == "baseline" and args.with_coord_aug else part, rows)
    print(f"results: {out / 'per_image.json'}, {out / 'per_image.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
