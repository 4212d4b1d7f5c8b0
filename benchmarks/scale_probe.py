#!/usr/bin/env python
"""Where a model's loss at a larger size comes from: its positions, its token grid or its content's scale.

    python -m benchmarks.scale_probe docs/resolution_transfer/runs/shapes-learned_multires-seed0-e48 --scale 4
    python -m benchmarks.scale_probe --smoke                                   # seconds: trains a tiny run and probes it

At ``s`` times the training size (coordinate route) a model meets three new things at once: positions at a new density,
``s^2`` times the tokens, and patches that each cover ``1/s^2`` of the area they covered in training. The probe takes
them apart on the test split, each cell against the same model at 1x:

- ``sx, positions of the (s/k)x grid``: the ``sx`` tokens, each ``k x k`` block given the coordinate of the ``(s/k)x``
  grid's cell it lies in (their mean), for every divisor ``k`` of ``s``. Unchanged top-1: the model does not read the
  positions' density (nor, at ``k = s``, any position finer than the training grid's). In extrapolate mode a block's
  mean keeps the fine grid's unit, so there it is the coarser layout, not the coarser grid's coordinates.
- ``sx grid, (s/2)x content``: the ``sx`` render average-pooled 2x2, patch-embedded, and each patch token repeated 2x2,
  so the ``sx`` token grid and positions carry the ``(s/2)x`` content. Back at the ``(s/2)x`` level: the content's
  scale was the loss; still at the ``sx`` level: the grid was.
- ``(s/2)x, pooled sx render``: the pooled images themselves at ``(s/2)x``, the control for what pooling changes.

And where the images go at ``sx``: for each class that loses, the class most of its images are taken for there (a
class read as another at the new scale, say a grating's cycles per patch, shows as a systematic shift).

Results go to OUT/scale_probe.json (every run and scale probed into it so far; a run probed again replaces its own
entry) and OUT/scale_probe.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.studykit import train_smoke
from vitpe.checkpoint import CheckpointError, checkpoint_config, find_checkpoint, model_from_checkpoint
from vitpe.coords import COORD_MODES, PatchGrid
from vitpe.evaluation import dataset_of, evaluate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "resolution_transfer" / "scale_probe"


def coarsened(grid: PatchGrid, k: int) -> PatchGrid:
    """``grid`` with every ``k x k`` block of tokens at its block's mean coordinate: in interpolate mode exactly the
    coordinates of the grid ``k`` times coarser, each repeated over its block. Not a lattice, so coordinates given
    directly (every PE reads them, the bias families too), with ``grid``'s extent (FIRE's normaliser)."""
    if grid.mode == "normalize":  # given directly, coordinates are in reference patches, and normalize's are not
        raise ValueError("the positions cell needs coordinates in reference patches: probe with --coord-mode interpolate "
                         "or extrapolate")
    h, w = grid.size
    c = grid.coords.reshape(h // k, k, w // k, k, 2).mean((1, 3), keepdim=True).expand(-1, k, -1, k, -1)
    return PatchGrid.from_coords(c.reshape(h * w, 2), grid.size, grid.ref, extent=tuple(grid.extent().tolist()))


@contextmanager
def pooled_tokens(model, factor: int) -> Iterator[None]:
    """While open, the patch embedding sees its input average-pooled ``factor x factor`` and repeats each resulting
    token over a ``factor x factor`` block: the input's token grid, carrying the content of an image ``factor`` times
    smaller."""
    pre = model.patch_embed.register_forward_pre_hook(lambda m, args: (F.avg_pool2d(args[0], factor),) + args[1:])
    post = model.patch_embed.register_forward_hook(
        lambda m, args, out: out.repeat_interleave(factor, -2).repeat_interleave(factor, -1))
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def shifts(at_1x: Tensor, at_sx: Tensor, names) -> List[Dict]:
    """Each class whose top-1 falls at ``sx``: its top-1 at 1x and ``sx`` and the class most of its images go to
    (``at_1x``, ``at_sx``: (true, predicted) class counts, :func:`vitpe.evaluation.evaluate`'s ``confusion``)."""
    out = []
    for c, (one, big) in enumerate(zip(at_1x, at_sx)):
        t1, ts = one[c].item() / max(one.sum().item(), 1), big[c].item() / max(big.sum().item(), 1)
        if ts < t1:
            to = int(big.argmax())
            out.append({"class": names[c], "top1_1x": t1, "top1_sx": ts, "goes_to": names[to],
                        "share": big[to].item() / max(big.sum().item(), 1)})
    return out


def label(s: float) -> str:
    return f"{s:g}x"


def probe(run: Path, scale: int, test_size: int, coord_mode: str) -> Dict:
    """Every cell of the module docstring for one run at ``scale`` times its training size."""
    if scale < 2:
        raise SystemExit(f"--scale {scale}: the probe takes a larger size apart; give an integer of 2 or more")
    model, state = model_from_checkpoint(run)
    model.eval()
    model.coord_mode = coord_mode
    cfg = checkpoint_config(state)
    ds = dataset_of(cfg, test_size=test_size)
    size, patch = cfg.model.img_size, model.patch_size

    def at(s: float) -> Tuple[Tensor, Tensor]:
        px = round(s * size)
        if px % patch:
            raise SystemExit(f"{s:g}x the training size is {px} px, not a multiple of the patch ({patch} px): choose another --scale")
        return ds.split(False, (px, px))

    def grid_at(k: int):
        return lambda m, x: coarsened(m.patch_grid(m.grid_size(x.shape[-2:]), x.device), k)

    big, labels = at(scale)
    cells: List[Tuple[str, float]] = []

    def measure(name: str, images: Tensor, **kw) -> Dict:
        res = evaluate(model, images, labels, ds.mean, ds.std, 250, progress=True, desc=f"{run.name} {name}", **kw)
        cells.append((name, res["top1"]))
        return res

    at_1x = measure("1x", at(1)[0], confusion=True)["confusion"]
    half = scale / 2
    if scale % 2 == 0 and half > 1:  # at 2x, the half size is the 1x cell itself
        measure(label(half), at(half)[0])
    at_sx = measure(label(scale), big, confusion=True)["confusion"]
    for k in (k for k in range(2, scale + 1) if scale % k == 0):
        measure(f"{label(scale)}, positions of the {label(scale / k)} grid", big, grid_of=grid_at(k))
    if scale % 2 == 0:
        with pooled_tokens(model, 2):
            measure(f"{label(scale)} grid, {label(half)} content", big)
        measure(f"{label(half)}, pooled {label(scale)} render", F.avg_pool2d(big.float(), 2).round().to(torch.uint8))
    base = cells[0][1]
    moved = shifts(torch.tensor(at_1x), torch.tensor(at_sx), ds.classes)
    return {"run": str(run.relative_to(ROOT) if run.is_relative_to(ROOT) else run), "pos_embed": cfg.model.pos_embed,
            "resolution_range": cfg.train.resolution_range, "train_size": size, "epochs": int(state["epoch"]),
            "scale": scale, "coord_mode": coord_mode, "n": len(labels),
            "cells": [{"cell": name, "top1": t, "change": t - base} for name, t in cells], "shifts": moved}


def markdown(results: List[Dict]) -> str:
    lines = ["# Where the loss at a larger size comes from", "",
             "Top-1 on the first test images (n), and its change from the model's 1x in points. Cells: "
             "`benchmarks/scale_probe.py`'s docstring.", ""]
    for r in results:
        sizes = "" if not r["resolution_range"] else f", trained at {r['resolution_range'][0]}-{r['resolution_range'][1]} px"
        lines += [f"## `{r['pos_embed']}`{sizes}, {r['scale']}x, {r['coord_mode']} ({r['run']}, {r['epochs']} epochs, n={r['n']})", "",
                  "| cell | top-1 | change |", "| --- | ---: | ---: |"]
        lines += [f"| {c['cell']} | {100 * c['top1']:.1f}% | {100 * c['change']:+.1f} |" for c in r["cells"]]
        if r.get("note"):
            lines += ["", r["note"]]
        if r.get("shifts"):  # (results probed before the shifts were recorded have none)
            lines += ["", f"Where each class that loses goes at {r['scale']}x:", "",
                      f"| class | top-1 at 1x | top-1 at {r['scale']}x | most taken for | share |", "| --- | ---: | ---: | --- | ---: |"]
            lines += [f"| {m['class']} | {100 * m['top1_1x']:.1f}% | {100 * m['top1_sx']:.1f}% | {m['goes_to']} | {100 * m['share']:.0f}% |"
                      for m in r["shifts"]]
        lines.append("")
    return "\n".join(lines)


def merge(path: Path, new: Dict) -> List[Dict]:
    """The results already in ``path`` with ``new`` in place of any entry for the same run, scale and mode."""
    key = lambda r: (r["run"], r["scale"], r["coord_mode"])  # noqa: E731
    old = json.loads(path.read_text()) if path.exists() else []
    return [r for r in old if key(r) != key(new)] + [new]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="run directories (or their checkpoint files)")
    p.add_argument("--scale", type=int, default=4, help="the larger size, in multiples of the training size (an integer, 2 or more)")
    p.add_argument("--test-size", type=int, default=1000, help="test images (the resolution study's 1000 by default)")
    p.add_argument("--coord-mode", choices=[m for m in COORD_MODES if m != "normalize"], default="interpolate",
                   help="the coordinate route's mode (normalize's coordinates cannot be given directly in reference patches)")
    p.add_argument("--out", help=f"where scale_probe.json and .md go (default: {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--smoke", action="store_true", help="train a tiny run for one epoch and probe it at 2x")
    args = p.parse_args(argv)
    if args.smoke:
        out = Path(args.out or tempfile.mkdtemp(prefix="scale_probe_"))
        args.runs, args.scale, args.test_size, args.out = [str(train_smoke(out, "learned"))], 2, 64, str(out)
    if not args.runs:
        p.error("give one or more run directories, or --smoke")
    out = Path(args.out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    for run in args.runs:
        try:
            result = probe(find_checkpoint(run).parent, args.scale, args.test_size, args.coord_mode)
        except CheckpointError as e:  # missing, corrupt or not vitpe's: the library's one line, without a traceback
            raise SystemExit(str(e)) from None
        results = merge(out / "scale_probe.json", result)
        (out / "scale_probe.json").write_text(json.dumps(results, indent=1))  # after each run: a stopped probe keeps the rest
        (out / "scale_probe.md").write_text(markdown(results))
        print(markdown([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
