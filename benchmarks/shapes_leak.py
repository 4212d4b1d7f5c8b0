#!/usr/bin/env python
"""What a model without position still reads on ``shapes``: its top-1 on the four arrangement classes by how much
play each pair had along its axis, and whether it is a bag of patches (shuffling its patches changes no prediction).

    python -m benchmarks.shapes_leak docs/resolution_transfer/runs/shapes-none-seed0-e48   # any shapes run, any PE
    python -m benchmarks.shapes_leak --smoke                                              # seconds: trains a tiny run

A pair that fills the image along its axis has almost nowhere else to go: where it sits, and so each shape's offset
within its patches, follows from the shapes' sizes, and a bag of patches can read the arrangement from those offsets.
With a patch or more of play (``vitpe.data.shapes.pair_play``) the offsets are spread and it can only guess (25%).
Results go to OUT/shapes_leak.json and OUT/shapes_leak.md (OUT: the run's directory unless --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch
from einops import rearrange
from torch import Tensor

from benchmarks.studykit import train_smoke
from vitpe.checkpoint import CheckpointError, checkpoint_config, find_checkpoint, model_from_checkpoint
from vitpe.data.augment import normalize
from vitpe.data.datasets import SHAPES_SEED
from vitpe.data.shapes import POSITION_CLASSES, pair_play, shapes_params
from vitpe.evaluation import dataset_of

ROOT = Path(__file__).resolve().parents[1]
PLAY_EDGES = (0.0, 0.01, 0.03, 1 / 16, 1 / 8, 1.0)  # image widths; the study's patch is 1/8 of its 32 px image


def shuffle_patches(x: Tensor, patch: int, generator: torch.Generator) -> Tensor:
    """The same images with their ``patch`` x ``patch`` blocks in one random order: a bag of patches sees no change."""
    h = x.shape[-2] // patch
    tokens = rearrange(x, "b c (h p) (w q) -> b (h w) c p q", p=patch, q=patch)
    order = torch.randperm(tokens.shape[1], generator=generator)
    return rearrange(tokens[:, order], "b (h w) c p q -> b c (h p) (w q)", h=h)


@torch.no_grad()
def logits(model, x: Tensor, batch: int = 500) -> Tensor:
    return torch.cat([model(x[i:i + batch]) for i in range(0, len(x), batch)])


def measure(run: Path) -> Dict:
    """The run's test split at its training size: top-1 overall and on the arrangement classes, per bin of play."""
    model, state = model_from_checkpoint(run)
    cfg = checkpoint_config(state)
    if cfg.data.name != "shapes":
        raise SystemExit(f"{run} was trained on {cfg.data.name!r}: this measures shapes' arrangement classes; give a shapes run")
    ds = dataset_of(cfg)
    images, labels = ds.split(False, (cfg.model.img_size,) * 2)
    params = shapes_params(len(labels), seed=SHAPES_SEED[False])
    assert torch.equal(params["label"], labels), "the test split is not shapes_params' test stream"
    x = normalize(images, ds.mean, ds.std)
    out = logits(model, x)
    shuffled = logits(model, shuffle_patches(x, cfg.model.patch_size, torch.Generator().manual_seed(0)))
    pred = out.argmax(-1)
    arrangement = torch.isin(labels, torch.tensor(POSITION_CLASSES))
    play = pair_play(params)
    bins: List[Dict] = []
    for lo, hi in zip(PLAY_EDGES, PLAY_EDGES[1:]):
        inside = arrangement & (play >= lo) & (play < hi) if hi < PLAY_EDGES[-1] else arrangement & (play >= lo)
        n = int(inside.sum())
        bins.append({"play_from": lo, "play_to": hi, "n": n,
                     "top1": (pred[inside] == labels[inside]).float().mean().item() if n else None})
    return {"run": str(run), "pos_embed": cfg.model.pos_embed, "epochs": int(state["epoch"]), "n": len(labels),
            "top1": (pred == labels).float().mean().item(),
            "arrangement_top1": (pred[arrangement] == labels[arrangement]).float().mean().item(),
            "arrangement_n": int(arrangement.sum()),
            "unchanged_by_shuffling": (pred == shuffled.argmax(-1)).float().mean().item(),
            "max_logit_change_by_shuffling": (out - shuffled).abs().max().item(), "bins": bins}


def markdown(r: Dict) -> str:
    lines = [f"# What `{r['pos_embed']}` reads on shapes ({r['run']}, {r['epochs']} epochs)", "",
             f"top-1 {100 * r['top1']:.1f}% on {r['n']} test images; {100 * r['arrangement_top1']:.1f}% on the "
             f"{r['arrangement_n']} images of the four arrangement classes (chance: 25%); predictions unchanged when the "
             f"patches are shuffled: {100 * r['unchanged_by_shuffling']:.1f}% (100%: a bag of patches)", "",
             "| play along the pair's axis (image widths) | pairs | top-1 |", "| --- | ---: | ---: |"]
    for b in r["bins"]:
        top1 = "-" if b["top1"] is None else f"{100 * b['top1']:.1f}%"
        lines.append(f"| {b['play_from']:.3f} to {b['play_to']:.3f} | {b['n']} | {top1} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a run directory trained on shapes, or its checkpoint file")
    p.add_argument("--out", help="where shapes_leak.json and .md go (default: the run's directory)")
    p.add_argument("--smoke", action="store_true", help="train a tiny run without a PE for one epoch and measure it")
    args = p.parse_args(argv)
    if args.smoke:
        args.run = str(train_smoke(Path(args.out or tempfile.mkdtemp(prefix="shapes_leak_")), "none"))
    if not args.run:
        p.error("give a run directory, or --smoke")
    try:
        result = measure(Path(args.run))
    except CheckpointError as e:  # missing, corrupt or not vitpe's: the library's one line, without a traceback
        raise SystemExit(str(e)) from None
    out = Path(args.out or find_checkpoint(args.run).parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shapes_leak.json").write_text(json.dumps(result, indent=1))
    (out / "shapes_leak.md").write_text(markdown(result))
    print(markdown(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
