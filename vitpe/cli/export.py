"""``vitpe export`` (``python -m vitpe.export`` in a clone): a trained run as an ONNX graph that takes any input size,
and in timm's file layout.

    vitpe export runs/main --onnx model.onnx          # EMA weights if the run kept them
    vitpe export runs/main --hf shared/ --raw         # the raw weights, for timm.create_model / the hub
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from ..checkpoint import find_checkpoint, model_from_checkpoint
from ..engine import memory_plan
from ..errors import command_name
from ..onnx import export_onnx, onnx_errors
from ..vit import VisionTransformer
from .common import parse_size, run_cli

__all__ = ["main", "cli"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=command_name("export"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1].strip('"\n'))
    p.add_argument("run", help="a run directory or its checkpoint.pt")
    p.add_argument("--onnx", metavar="PATH", help="write an ONNX graph that takes any input size")
    p.add_argument("--hf", metavar="DIR", help="write timm's layout (config.json + model.safetensors), for timm and the hub")
    p.add_argument("--raw", action="store_true", help="the raw weights even if the run kept an EMA (default: the EMA's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file or folder")
    p.add_argument("--check", metavar="N|HxW", nargs="*", default=None, type=parse_size,
                   help="with --onnx: run the file with onnxruntime at these sizes (default: the training size, 1.5x, 2x)")
    args = p.parse_args(argv)
    if not args.onnx and not args.hf:
        p.error("say what to write: --onnx PATH, --hf DIR, or both")
    model, state = model_from_checkpoint(args.run, ema=not args.raw)
    weights = "raw" if args.raw or state.get("ema") is None else "EMA"
    source = find_checkpoint(args.run)
    if args.onnx:
        if Path(args.onnx).exists() and Path(args.onnx).resolve() == source.resolve():
            raise FileExistsError(f"--onnx {args.onnx} is the run's own checkpoint; write the graph elsewhere, e.g. "
                                  f"{source.with_name('model.onnx')}")
        sizes = args.check or _default_sizes(model) if args.check is not None else []
        for size in sizes:
            model.grid_size(size)
        batch = min(memory_plan(model, [(s, None) for s in sizes], 2, torch.device("cpu"), str(args.run),
                                explicit=True).values(), default=2)
        path = export_onnx(model, args.onnx, overwrite=args.overwrite)
        print(f"wrote {path} ({weights} weights; any height and width that are multiples of {model.patch_size})")
        if sizes:
            for (h, w), err in onnx_errors(model, path, sizes, batch=batch).items():
                print(f"  onnxruntime at {h}x{w}: relative difference {err:.1e} from PyTorch")
    if args.hf:
        from ..timm.pretrained import save_pretrained

        folder = save_pretrained(model, args.hf, overwrite=args.overwrite)
        print(f"wrote {folder} ({weights} weights): vitpe.from_pretrained or timm.create_model('vitpe_vit', pretrained=True, ...)")
    return 0


def _default_sizes(model: VisionTransformer) -> Sequence[Tuple[int, int]]:
    from ..coords import snap

    h, w = model.img_size
    return [(h, w)] + [(snap(h * s, model.patch_size), snap(w * s, model.patch_size)) for s in (1.5, 2)]


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)
