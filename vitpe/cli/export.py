"""``vitpe export`` (``python -m vitpe.export`` in a clone): a trained run as an ONNX graph that takes any input size,
and in timm's file layout.

    vitpe export runs/main --onnx model.onnx          # EMA weights if the run kept them
    vitpe export runs/main --hf shared/ --raw         # the raw weights, for timm.create_model / the hub
    vitpe export runs/main --onnx m64.onnx --size 64  # for 64-px images: the route the run's plan chose there

With ``--size``, the graph computes the route to that size (``--route auto``: the one ``vitpe eval RUN --plan`` chose,
else new coordinates): the coordinate route in its mode, the patch route's resized patch embedding, or for the resize
route the model at its own size. The file's metadata says what its images need: ``input_size`` (the training size for
the resize route) and ``vitpe_route`` (the route, the size it serves, the preprocessing in words).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..checkpoint import find_checkpoint, model_from_checkpoint
from ..config import ConfigError
from ..engine import memory_plan
from ..errors import command_name
from ..evaluation import route_inputs
from ..onnx import export_onnx, onnx_errors
from ..route_plan import Route, route_for, size_key
from ..vit import VisionTransformer
from .common import parse_size, route_arg, run_cli

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
                   help="with --onnx: run the file with onnxruntime at these sizes (default: the training size, 1.5x, 2x; "
                        "with --size: that size)")
    p.add_argument("--size", type=parse_size, metavar="N|HxW",
                   help="with --onnx: the size the graph will be given, taken by --route (default: the training size)")
    p.add_argument("--route", type=route_arg, default="auto", metavar="ROUTE",
                   help="with --size: auto (the run's plan where it has one for the size, from vitpe eval RUN --plan; else "
                        "coords), coords or coords:MODE, patch (the graph runs the resized patch embedding), resize (the graph "
                        "is the model at its own size; the file's preprocessing says to resize to it)")
    args = p.parse_args(argv)
    if not args.onnx and not args.hf:
        p.error("say what to write: --onnx PATH, --hf DIR, or both")
    model, state = model_from_checkpoint(args.run, ema=not args.raw)
    weights = "raw" if args.raw or state.get("ema") is None else "EMA"
    source = find_checkpoint(args.run)
    own = tuple(model.img_size)
    size = args.size or own
    if args.hf and size != own:
        raise ConfigError(f"timm's layout ships the model at its own size {size_key(own)}; a route to {size_key(size)} ships as "
                          f"ONNX: --onnx FILE --size {size_key(size)} (and --hf without --size)")
    route, note = route_for(args.run, model, state, size, args.route, ema=not args.raw)
    if note:
        print(f"note: {note}")
    patch, resize = route_inputs(model, route.kind, size)  # a size the route cannot make: one line
    model.coord_mode = route.coord_mode
    if args.onnx:
        if Path(args.onnx).exists() and Path(args.onnx).resolve() == source.resolve():
            raise FileExistsError(f"--onnx {args.onnx} is the run's own checkpoint; write the graph elsewhere, e.g. "
                                  f"{source.with_name('model.onnx')}")
        seen = resize or size  # what the graph is given
        default = [seen] if args.size else _default_sizes(model)
        sizes = args.check or default if args.check is not None else []
        for s in sizes:
            model.grid_size(s, patch)
        batch = min(memory_plan(model, [(s, patch) for s in sizes], 2, torch.device("cpu"), str(args.run),
                                explicit=True).values(), default=2)
        path = export_onnx(model, args.onnx, overwrite=args.overwrite, patch_size=patch, metadata=route_metadata(model, route, size, seen))
        p_in = patch or model.patch_size
        how = "" if size == own else (f"; images {size_key(size)} resized to {size_key(seen)} first (route resize: the file's "
                                      "input_size)" if resize else f"; route {route.name} at {size_key(size)}")
        print(f"wrote {path} ({weights} weights; any height and width that are multiples of {p_in}{how})")
        if sizes:
            for (h, w), err in onnx_errors(model, path, sizes, batch=batch, patch_size=patch).items():
                print(f"  onnxruntime at {h}x{w}: relative difference {err:.1e} from PyTorch")
    if args.hf:
        from ..timm.pretrained import save_pretrained

        folder = save_pretrained(model, args.hf, overwrite=args.overwrite)
        print(f"wrote {folder} ({weights} weights): vitpe.from_pretrained or timm.create_model('vitpe_vit', pretrained=True, ...)")
    return 0


def route_metadata(model: VisionTransformer, route: Route, size: Tuple[int, int], seen: Tuple[int, int]) -> Dict[str, Any]:
    """What an ONNX file of ``route`` at ``size`` says its images need: ``input_size`` (the model's own for the resize
    route, ``size`` otherwise) and ``vitpe_route`` (the route, the size it serves, the model's own, in words)."""
    if size == tuple(model.img_size):
        return {}
    steps = {"resize": f"resize each {size_key(size)} image to {size_key(seen)} (an area average), then normalize",
             "patch": f"normalize the {size_key(size)} image; the graph runs the patch embedding resized to {size[0] // model.ref_grid[0]} px",
             "coords": f"normalize the {size_key(size)} image; the graph gives it new coordinates ({route.coord_mode})"}
    return {"input_size": [model.in_chans, *seen], "vitpe_route": {"route": route.name, "size": list(size),
                                                                    "model_size": list(model.img_size), "preprocess": steps[route.kind]}}


def _default_sizes(model: VisionTransformer) -> Sequence[Tuple[int, int]]:
    from ..coords import snap

    h, w = model.img_size
    return [(h, w)] + [(snap(h * s, model.patch_size), snap(w * s, model.patch_size)) for s in (1.5, 2)]


def cli(argv: Optional[Sequence[str]] = None) -> int:
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)
