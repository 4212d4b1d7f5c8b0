"""The ``vitpe`` command (``python -m vitpe``): one door to every command, installed or in a clone.

    vitpe train                                  # the main job (python train.py in a clone)
    vitpe train --config fashion_mnist --pe rope_mixed
    vitpe eval runs/NAME --resolutions 16 32 64  # python eval.py
    vitpe predict photo.png --run runs/NAME      # python -m vitpe.predict
    vitpe export runs/NAME --onnx model.onnx     # python -m vitpe.export
    vitpe viz heatmap --pe rope_mixed            # python -m vitpe.viz
    vitpe shards photos/ photos-shards           # an image folder as tar shards: --data shards:photos-shards
    vitpe configs                                # the shipped configs, by name for --config

Each command's module is imported only when it runs, so ``vitpe --help`` answers at once. The commands live in this
wing, a module each (:mod:`.train`, :mod:`.eval`, :mod:`.predict`, :mod:`.export`, :mod:`.viz`), and share one size
parser and one error convention (:mod:`.common`); the work is the library's. ``train.py``, ``eval.py`` and
``python -m vitpe.predict`` (``.export``, ``.viz``) are the clone's doors to the same commands.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["COMMANDS", "main"]

# name -> (module, its function taking argv, what it does)
COMMANDS: Dict[str, Tuple[str, str, str]] = {
    "train": ("vitpe.cli.train", "cli", "train a classifier, resume a run, or fine-tune from a model (--init)"),
    "eval": ("vitpe.cli.eval", "cli", "measure trained runs or exported models at several resolutions"),
    "predict": ("vitpe.cli.predict", "cli", "classify image files with a run or an exported model"),
    "export": ("vitpe.cli.export", "cli", "write a run as ONNX (any input size) or in timm's layout"),
    "viz": ("vitpe.cli.viz", "cli", "draw a PE's similarity, attention distance and more"),
    "shards": ("vitpe.cli.shards", "cli", "write an image folder as tar shards, for many processes and machines"),
    "configs": ("vitpe.cli", "list_configs", "list the shipped configs, which --config takes by name"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: vitpe COMMAND [ARGS]   (vitpe COMMAND --help: its options)", "", "commands:"]
    return "\n".join(lines + [f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items()])


def list_configs(argv: Optional[List[str]] = None) -> int:
    from vitpe.config import shipped_config_names, shipped_configs

    if argv:
        print(f"error: vitpe configs takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    folder = shipped_configs()
    for name in shipped_config_names():
        first = next((line.lstrip("# ").strip() for line in (folder / f"{name}.yaml").read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:<22} {first}")
    print(f"(in {folder})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        from vitpe.suggest import did_you_mean

        print(f"error: no command {name!r}{did_you_mean(name, COMMANDS)}; the commands: {', '.join(COMMANDS)} (vitpe --help)",
              file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    run: Callable[[Optional[List[str]]], int] = getattr(importlib.import_module(module), function)
    program, sys.argv[0] = sys.argv[0], f"vitpe {name}"  # usage lines and a run's hints name the command as typed
    try:
        return run(rest)
    finally:
        sys.argv[0] = program
