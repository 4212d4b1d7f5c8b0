"""``vitpe train`` (``python train.py`` in a clone): train a ViT classifier with any positional encoding, resume a
run, or fine-tune from a model.

    vitpe train                                        # shapes, the built-in dataset, ~4 min on 2 CPU cores
    vitpe train --config fashion_mnist --pe FAMILY
    vitpe train --resume runs/RUN
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml     # gloo on CPU, NCCL on GPUs

Every run gets its own directory (never overwritten, locked while it trains) holding config.yaml,
checkpoint.pt (written atomically each epoch, and at the next step boundary on Ctrl-C or SIGTERM) and
metrics.jsonl / metrics.csv. The work is :func:`vitpe.training.train`'s; this module reads the command line.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from ..config import shipped_config_names
from ..training import DEFAULT_CONFIG, train
from .common import run_cli

__all__ = ["main", "cli", "parse_args", "cli_overrides"]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a YAML file, or a shipped config by name: "
                   f"{', '.join(shipped_config_names())} (default: {DEFAULT_CONFIG.stem})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=5e-4 --set train.epochs=5")
    p.add_argument("--data", help="shortcut for --set data.name=NAME")
    p.add_argument("--data-dir", help="shortcut for --set data.data_dir=DIR")
    p.add_argument("--pe", help="shortcut for --set model.pos_embed=NAME")
    p.add_argument("--epochs", type=int, help="shortcut for --set train.epochs=N")
    p.add_argument("--name", help="run directory name under out_dir (must not exist yet)")
    p.add_argument("--out-dir", help="where run directories go (default: runs)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run exactly where it stopped")
    p.add_argument("--init", metavar="SOURCE", help="start from a model: a run directory or checkpoint, a save_pretrained folder, or "
                   "timm:NAME (shortcut for --set init.source=SOURCE; default config then configs/finetune.yaml)")
    p.add_argument("--init-weights", metavar="FILE", help="with --init timm:NAME: its weights (.safetensors, .pth, .bin)")
    p.add_argument("--no-verify", action="store_true", help="resume from a checkpoint whose checksum does not match")
    return p.parse_args(argv)


def cli_overrides(args: argparse.Namespace) -> List[str]:
    """The ``key=value`` overrides the command line gives, its shortcuts (``--data``, ``--epochs``, ...) included."""
    shortcuts = [("data.name", args.data), ("data.data_dir", args.data_dir), ("model.pos_embed", args.pe),
                 ("train.epochs", args.epochs), ("name", args.name), ("out_dir", args.out_dir), ("init.source", args.init),
                 ("init.weights", args.init_weights)]
    return [f"{k}={v}" for k, v in shortcuts if v is not None] + args.overrides


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    return train(args.config, cli_overrides(args), resume=args.resume, verify=not args.no_verify)


def cli(argv: Optional[List[str]] = None) -> int:
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)
