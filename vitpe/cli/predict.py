"""``vitpe predict`` (``python -m vitpe.predict`` in a clone): the top classes of image files, as a table or JSON lines.

    vitpe predict photo.png more/*.jpg --run runs/NAME          # top 3 classes of each image
    vitpe predict digit.png --run runs/NAME --size 48 --top 5    # at another resolution: new coordinates

Each image is read as the run's data was (RGB, or grayscale for 1-channel data), resized to the training size
(or ``--size``, any multiple of the patch size, ``HxW`` for non-square), normalised with the dataset's statistics
and classified by the run's EMA weights when it kept them (``--no-ema``: the raw ones). ``--run`` may also be a
folder ``vitpe export --hf`` wrote: it carries the run's normalization and class names.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

import torch

from ..data.images import read_images
from ..engine import memory_plan
from ..errors import command_name
from ..evaluation import predict, shipped_model
from .common import parse_size, run_cli

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
    model.grid_size(size)  # one clear line for a size that is not a multiple of the patch size
    batch = memory_plan(model, [(size, None)], 64, torch.device("cpu"), str(args.run), model.img_size)[size]  # refuses a size that cannot fit
    images = read_images(args.images, data["in_chans"], size)
    probs, index = predict(model, images, data["mean"], data["std"], args.top, batch)
    classes = data["classes"]
    for path, ps, ix in zip(args.images, probs.tolist(), index.tolist()):
        ranked = [(classes[i], round(q, 4)) for i, q in zip(ix, ps)]
        if args.json:
            print(json.dumps({"image": str(path), "top": [{"class": c, "p": q} for c, q in ranked]}))
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

