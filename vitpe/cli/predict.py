"""``vitpe predict`` (``python -m vitpe.predict`` in a clone): the top classes of image files, as a table or JSON lines.

    vitpe predict photo.png more/*.jpg --run runs/NAME          # top 3 classes of each image
    vitpe predict digit.png --run runs/NAME --size 48 --top 5    # at another size: the run's planned route, else new coordinates
    vitpe predict digit.png --run runs/NAME --size 64 --route resize   # a route by hand: coords[:MODE], patch, resize

Each image is read as the run's data was (RGB, or grayscale for 1-channel data), resized to the training size
(or ``--size``, any multiple of the patch size, ``HxW`` for non-square), normalised with the dataset's statistics,
taken to the model by the route (``--route auto``: the one ``vitpe eval RUN --plan`` chose for that size, where the run
has a plan; new coordinates otherwise) and classified by the run's EMA weights when it kept them (``--no-ema``: the raw ones). ``--run`` may also be a
folder ``vitpe export --hf`` wrote: it carries the run's normalization and class names.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

import torch

from ..checkpoint import load_checkpoint
from ..data.images import read_images
from ..engine import memory_plan
from ..errors import command_name
from ..evaluation import predict, route_inputs, shipped_model
from ..route_plan import plan_path, route_for
from ..timm.pretrained import is_exported
from .common import parse_size, route_arg, run_cli

__all__ = ["main", "cli"]


def top_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--top takes a whole number of classes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--top must be at least 1 (the classes to show per image), got {value}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=command_name("predict"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files (a name that starts with '-': put -- before it, or ./-name.png)")
    p.add_argument("--run", required=True, metavar="RUN_OR_EXPORT", help="the trained run (runs/NAME), its checkpoint.pt, or a folder "
                   f"{command_name('export')} --hf wrote")
    p.add_argument("--size", type=parse_size, metavar="N|HxW", help="input size (default: the training size)")
    p.add_argument("--route", type=route_arg, default="auto", metavar="ROUTE",
                   help="how the model meets --size: auto (the run's plan where it has one for the size, from vitpe eval RUN "
                        "--plan; else coords), coords or coords:MODE (new coordinates), patch (resized patch embedding), resize "
                        "(each image resized to the training size)")
    p.add_argument("--top", type=top_count, default=3, help="classes to show per image (default 3)")
    p.add_argument("--no-ema", action="store_true", help="the raw weights even if the run kept an EMA")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of the table")
    args, unknown = p.parse_known_args(argv)
    # A file named like an option (-dash.png) is an image all the same; anything else unknown is an error, as argparse says.
    files = [a for a in unknown if Path(a).is_file()]
    if len(files) < len(unknown):
        p.error(f"unrecognized arguments: {' '.join(a for a in unknown if a not in files)} (an image whose name starts with '-': put -- before it)")
    args.images += files
    if not args.images:
        p.error("give at least one image file")
    model, data = shipped_model(args.run, ema=not args.no_ema)
    size = args.size or tuple(model.img_size)
    # the checkpoint a plan is checked against (read again, unverified: shipped_model verified it), where there is a plan
    planned = not is_exported(args.run) and plan_path(args.run).is_file()
    state = load_checkpoint(args.run, verify=False) if planned and args.route == "auto" and size != tuple(model.img_size) else None
    route, note = route_for(args.run, model, state, size, args.route, ema=not args.no_ema)
    if note:
        print(f"note: {note}", file=sys.stderr)
    patch, resize = route_inputs(model, route.kind, size)  # one clear line for a size the route cannot make
    if route.kind == "coords":
        model.grid_size(size)  # one clear line for a size that is not a multiple of the patch size
    model.coord_mode = route.coord_mode
    seen = resize or size  # the size the model computes at
    batch = memory_plan(model, [(seen, patch)], 64, torch.device("cpu"), str(args.run), model.img_size)[seen]  # refuses a size that cannot fit
    images = read_images(args.images, data["in_chans"], size)
    probs, index = predict(model, images, data["mean"], data["std"], args.top, batch, route.kind)
    classes = data["classes"]
    for path, ps, ix in zip(args.images, probs.tolist(), index.tolist()):
        ranked = [(classes[i], round(q, 4)) for i, q in zip(ix, ps)]
        if args.json:
            print(json.dumps({"image": str(path), "top": [{"class": c, "p": q} for c, q in ranked], "route": route.name}))
        else:
            # the path as given (two 0.png in different folders stay apart); a name with a newline or other control
            # character is quoted and escaped, so that each image stays one line
            print(f"{_one_line(str(path))}: " + ", ".join(f"{_one_line(c)} {q:.3f}" for c, q in ranked))
    return 0


def _one_line(text: str) -> str:
    return text if text.isprintable() else json.dumps(text)


def cli(argv: Optional[List[str]] = None) -> int:
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)

