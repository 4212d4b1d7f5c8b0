#!/usr/bin/env python
"""Accuracy on real data: the best Fashion-MNIST ViT a budget buys, and every PE family at equal budget.

    python -m benchmarks.accuracy --suite fmnist                      # 15-min CPU recipe (configs/fashion_mnist_cpu.yaml)
    python -m benchmarks.accuracy --suite fmnist --config configs/fashion_mnist.yaml   # the longer (GPU) recipe
    python -m benchmarks.accuracy --suite pe --seeds 0 1              # every family x seeds, shapes and Fashion-MNIST
    python -m benchmarks.accuracy --suite main --seeds 0 1 2          # the main job (configs/shapes.yaml) and the same without PE
    python -m benchmarks.accuracy --smoke                             # seconds: checks the script still runs

Every number is the last epoch's test top-1 on the full test split (no best-epoch picking). Runs go to
OUT/runs/ (a finished run is reused, an interrupted one resumed); results to OUT/accuracy.json and
OUT/accuracy.csv (one row per run, merged with earlier rows), OUT/pe_table.md and OUT/pe_table.png
(mean, sample standard deviation and every seed). The main suite also records its results by PE in
vitpe/reference_runs.json, which a finished run of the same recipe compares itself to (its last lines).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

import vitpe
from benchmarks.studykit import TrainSpec, smoke_args, train_or_reuse
from benchmarks.timing import cpu_name
from vitpe.checkpoint import checkpoint_config, load_checkpoint
from vitpe.config import load_config
from vitpe.data import load_dataset
from vitpe.runs import safe_name, write_csv
from vitpe.training import REFERENCE_FILE, position_top1, recipe_of

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "configs"
# The PE comparison: one recipe per dataset, only the PE changes. Budgets sized for 2 CPU cores (about a
# minute per run); they rank the families at a short budget, which favours the fixed encodings.
PE_RECIPES: Dict[str, TrainSpec] = {
    "shapes": TrainSpec(str(CONFIGS / "shapes.yaml"), ("train.epochs=3", "train.resolution_range=null")),
    "fashion_mnist": TrainSpec(str(CONFIGS / "fashion_mnist_cpu.yaml"), ("train.budget_min=null", "train.epochs=1", "train.warmup_epochs=0.2",
                                                                         "train.eval_tta=none")),
}


def result_row(run: Path, suite: str, data: str, seed: int) -> Dict:
    state = load_checkpoint(run)
    last = state["metrics"][-1]
    params = sum(t.numel() for t in vitpe.VisionTransformer(**state["model_args"]).parameters())  # learned only, no buffers
    cfg = checkpoint_config(state).to_dict()  # typed (defaults for keys added since), stored as plain values
    return {"suite": suite, "data": data, "pe": cfg["model"]["pos_embed"], "seed": seed, "top1": last["test_top1"], "test_loss": last["test_loss"],
            "params": params, "epochs": last["epoch"], "train_wall_s": last["wall_s"],
            "train_steps_s": sum(r["epoch_s"] for r in state["metrics"]), "budget": state.get("budget"), "cpu": cpu_name(),
            "images_per_s": round(last["images_per_s"], 1), "model": cfg["model"], "recipe": {k: cfg[k] for k in ("data", "train")},
            "device": str(cfg["train"]["device"]), "torch": torch.__version__, "run": str(run)}


def write_reference(rows: List[Dict], path: Path) -> None:
    """The main suite's results by PE, under their recipe, in ``path`` (other recipes' entries are kept)."""
    state = load_checkpoint(rows[0]["run"])
    cfg = checkpoint_config(state)
    position = load_dataset(cfg.data.name, train_size=1, test_size=1).position_classes
    results: Dict[str, Dict[str, list]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        per = load_checkpoint(r["run"])["metrics"][-1]["test_per_class_top1"]
        entry = results.setdefault(r["pe"], {"seeds": [], "top1": [], "position_top1": [], "train_wall_s": []})
        entry["seeds"].append(r["seed"])
        entry["top1"].append(round(r["top1"], 4))
        entry["position_top1"].append(round(position_top1(per, position), 4) if position else None)
        entry["train_wall_s"].append(round(r["train_wall_s"], 1))
    recipe = recipe_of(cfg)
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries = [e for e in entries if e["recipe"] != recipe] + [{
        "measured": f"{time.strftime('%Y-%m-%d')}, {rows[0]['cpu']}, torch {torch.__version__}",
        "command": "python -m benchmarks.accuracy --suite main", "recipe": recipe, "results": results}]
    path.write_text(json.dumps(entries, indent=1) + "\n")


def write_outputs(rows: List[Dict], out: Path) -> None:
    (out / "accuracy.json").write_text(json.dumps(rows, indent=1))
    write_csv(rows, out / "accuracy.csv")
    pe_rows = [r for r in rows if r["suite"] == "pe"]
    if pe_rows:
        write_pe_table(pe_rows, out)


def summarise(rows: List[Dict]) -> Dict[str, Dict[str, Dict]]:
    """``{data: {pe: {mean, sd, seeds, n}}}`` in percent; sd is the sample standard deviation (0 for one seed)."""
    table: Dict[str, Dict[str, Dict]] = {}
    for data in dict.fromkeys(r["data"] for r in rows):
        for pe in dict.fromkeys(r["pe"] for r in rows if r["data"] == data):
            acc = [100 * r["top1"] for r in sorted(rows, key=lambda r: r["seed"]) if r["data"] == data and r["pe"] == pe]
            table.setdefault(data, {})[pe] = {"mean": statistics.fmean(acc), "sd": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                                              "seeds": acc, "n": len(acc)}
    return table


def write_pe_table(rows: List[Dict], out: Path) -> None:
    table = summarise(rows)
    datas = list(table)
    pes = list(dict.fromkeys(pe for d in datas for pe in table[d]))
    lines = ["| PE | " + " | ".join(f"{d}: mean ± sd (seeds)" for d in datas) + " |", "| --- |" + " ---: |" * len(datas)]
    for pe in pes:
        cells = []
        for d in datas:
            c = table[d].get(pe)
            cells.append("-" if c is None else f"{c['mean']:.1f} ± {c['sd']:.1f} ({', '.join(f'{a:.1f}' for a in c['seeds'])})")
        lines.append(f"| {pe} | " + " | ".join(cells) + " |")
    (out / "pe_table.md").write_text("\n".join(lines) + "\n")

    from vitpe.viz import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(datas), figsize=(5.5 * len(datas), 4), squeeze=False)
    for ax, d in zip(axes[0], datas):
        names = list(table[d])
        for i, pe in enumerate(names):
            c = table[d][pe]
            ax.bar(i, c["mean"], color="#9ecae1" if pe != "none" else "#d9d9d9", yerr=c["sd"], capsize=3)
            ax.plot([i] * c["n"], c["seeds"], "k.", ms=4)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        lo = min(min(c["seeds"]) for c in table[d].values())
        ax.set_ylim(max(0.0, lo - 5), min(100.0, max(max(c["seeds"]) for c in table[d].values()) + 3))
        ax.set_ylabel("test top-1 (%)")
        ax.set_title(f"{d}: mean ± sd, dots = seeds")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "pe_table.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=["fmnist", "pe", "main"], default="fmnist")
    p.add_argument("--config", help="fmnist suite: the recipe (default configs/fashion_mnist_cpu.yaml); main: configs/shapes.yaml")
    p.add_argument("--reference", default=str(REFERENCE_FILE), help="main suite: where its results by PE are recorded")
    p.add_argument("--data", nargs="+", default=list(PE_RECIPES), choices=list(PE_RECIPES), help="pe suite: datasets")
    p.add_argument("--pes", nargs="+", help="pe suite: families (default: every registered one)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--smoke", action="store_true", help="tiny config on shapes, two PEs, two seeds: seconds")
    args = p.parse_args(argv)
    args.config = args.config or str(CONFIGS / ("shapes.yaml" if args.suite == "main" else "fashion_mnist_cpu.yaml"))
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)

    jobs = []  # (suite, data, pe, seed, the run); the fmnist suite's PE is its config's
    if args.smoke:
        suite = "main" if args.suite == "main" else "pe"
        for pe in args.pes or ["none", "rope_mixed"]:
            jobs += [(suite, "shapes", pe, s, smoke_args(pe)) for s in (0, 1)]
    elif args.suite == "main":  # the config's own PE and the same recipe without one
        main_cfg = load_config(args.config)
        for pe in args.pes or list(dict.fromkeys([main_cfg.model.pos_embed, "none"])):
            jobs += [("main", main_cfg.data.name, pe, s, TrainSpec(args.config, (f"model.pos_embed={pe}",))) for s in args.seeds]
    elif args.suite == "fmnist":
        jobs = [("fmnist", "fashion_mnist", "", s, TrainSpec(args.config)) for s in args.seeds]
    else:
        for data in args.data:
            for pe in args.pes or vitpe.list_pos_embeds():
                jobs += [("pe", data, pe, s, PE_RECIPES[data].plus(f"model.pos_embed={pe}")) for s in args.seeds]

    previous = json.loads((out / "accuracy.json").read_text()) if (out / "accuracy.json").is_file() else []
    started, rows = time.time(), []
    for suite, data, pe, seed, cmd in jobs:
        # Overrides are part of the name: a finished run is reused by name, so other settings need another one.
        tag = "-".join([{"fmnist": Path(args.config).stem, "main": f"{Path(args.config).stem}-{pe}"}.get(suite, f"{data}-{pe}"), *args.set])
        name = safe_name(f"{suite}-{tag}-seed{seed}")
        run = train_or_reuse(runs / name, cmd.plus(f"train.seed={seed}", *args.set), name)
        row = result_row(run, suite, data, seed)
        row["recipe_name"] = tag if suite == "fmnist" else data
        rows.append(row)
        print(f"[{name}] top-1 {100 * row['top1']:.2f}% ({row['params'] / 1e6:.2f}M params, {row['train_wall_s'] / 60:.1f} min training)")
        done = {r["run"] for r in rows}
        write_outputs([r for r in previous if r["run"] not in done] + rows, out)  # a partial study stays readable
    if args.suite == "main" and rows:
        write_reference(rows, Path(args.reference))
        for pe in dict.fromkeys(r["pe"] for r in rows):
            top = [100 * r["top1"] for r in rows if r["pe"] == pe]
            print(f"main job, pe={pe}: {statistics.mean(top):.2f}% over seeds ({', '.join(f'{t:.2f}' for t in top)})")
        print(f"recorded in {args.reference}")
    if len(rows) > 1 and args.suite == "fmnist":
        top = [100 * r["top1"] for r in rows]
        print(f"{rows[0]['recipe_name']}: {statistics.mean(top):.2f} +- {statistics.stdev(top):.2f}% over seeds {args.seeds} "
              f"({', '.join(f'{t:.2f}' for t in top)}), {statistics.mean(r['train_steps_s'] for r in rows) / 60:.1f} min of steps each")
    print(f"done in {(time.time() - started) / 60:.1f} min: {out / 'accuracy.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
