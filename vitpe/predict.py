"""Classify image files with a trained run: the top classes of each, as a table (or JSON).

    python -m vitpe.predict photo.png more/*.jpg --run runs/NAME          # top 3 classes of each image
    python -m vitpe.predict digit.png --run runs/NAME --size 48 --top 5    # at another resolution: new coordinates

Each image is read as the run's data was (RGB, or grayscale for 1-channel data), resized to the training size
(or ``--size``, any multiple of the patch size, ``HxW`` for non-square), normalised with the dataset's statistics
and classified by the run's EMA weights when it kept them (``--no-ema``: the raw ones). ``--run`` may also be a
folder ``python -m vitpe.export --hf`` wrote: it carries the run's normalization and class names.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .checkpoint import model_from_checkpoint
from .data.augment import normalize
from .data.images import open_image
from .engine import memory_plan
from .errors import command_name, run_cli
from .pretrained import exported_run, is_exported

__all__ = ["read_images", "predict", "shipped_model", "main"]


def read_images(paths: Sequence[str], in_chans: int, size: Tuple[int, int]) -> Tensor:
    """uint8 ``(N, in_chans, h, w)``: each file decoded upright (:func:`vitpe.data.images.open_image`: EXIF orientation
    applied), converted (RGB or grayscale) and resized bicubically to ``size``."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    out = []
    for path in paths:
        rgb = open_image(path)
        im = rgb if in_chans == 3 else rgb.convert("L")
        out.append(pil_to_tensor(im.resize(size[::-1], Image.BICUBIC)))
    return torch.stack(out)


def shipped_model(path: str, ema: bool = True) -> Tuple[torch.nn.Module, Dict]:
    """The model at ``path`` (a run, its checkpoint, or a folder :func:`vitpe.save_pretrained` or ``python -m
    vitpe.export --hf`` wrote) and how its images are read: ``in_chans``, ``mean``, ``std``, ``classes`` (an exported
    folder without names: the head's row numbers)."""
    model, state = exported_run(path) if is_exported(path) else model_from_checkpoint(path, ema=ema)
    return model, state["data"]


@torch.no_grad()
def predict(model: torch.nn.Module, images: Tensor, mean: Sequence[float], std: Sequence[float], top: int = 3,
            batch_size: int = 64) -> Tuple[Tensor, Tensor]:
    """Top-``top`` probabilities and class indices ``(N, top)`` of uint8 ``images``, ``batch_size`` images at a time."""
    model.eval()
    probs = torch.cat([model(normalize(x, mean, std)).float().softmax(-1) for x in images.split(batch_size)])
    return probs.topk(min(top, probs.shape[-1]), dim=-1)


def parse_size(text: str) -> Tuple[int, int]:
    h, sep, w = text.lower().partition("x")
    try:
        size = int(h), int(w if sep else h)  # "16x" is a typo, not 16x16
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must be N or HxW, got {text!r}") from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return size


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
                   "python -m vitpe.export --hf wrote")
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
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
