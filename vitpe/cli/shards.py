"""``vitpe shards``: an image folder written once as tar shards (WebDataset's format), for training on many processes
and machines with ``--data shards:DIR``.

    vitpe shards photos/ /data/photos-shards              # train/ and test/ (or val/), or one folder split 90/10
    vitpe shards photos/ /data/photos-shards --shards 128  # more shards: for more than 64 processes
    torchrun --nproc_per_node 2 train.py --data shards:/data/photos-shards
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ..data.shard_writer import write_shards
from ..errors import command_name
from .common import positive_int, run_cli

__all__ = ["main", "cli"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog=command_name("shards"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1].strip('"\n'))
    p.add_argument("folder", help="an image folder, one sub-folder per class, as --data imagefolder:PATH reads it")
    p.add_argument("out", help="a new folder for the shards and their index, shards.json")
    p.add_argument("--shards", type=positive_int, default=None,
                   help="training shards (default: a multiple of 64 with at most 1,000 pictures each); the processes of a run "
                        "share them, so give at least that many, ideally a multiple")
    p.add_argument("--seed", type=int, default=0, help="the shuffle that mixes the classes across shards")
    args = p.parse_args(argv)
    out = write_shards(args.folder, args.out, args.shards, args.seed)
    print(f"wrote {out}; train on it with: {command_name('train')} --data shards:{out}")
    return 0


def cli(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli(main, argv)
