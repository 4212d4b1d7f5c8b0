"""An image folder written as tar shards (WebDataset's format) that :mod:`vitpe.data.shards` reads: the folder read once
as :func:`~vitpe.data.load_dataset` reads it (each picture once, copies kept off both sides of the split, class names
checked), then each file's own bytes stored with its label."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, List, Optional, Union

import torch

from .datasets import load_dataset
from .images import DataError
from .shards import FORMAT, INDEX, webdataset_module
from .stream import aspect_of

__all__ = ["write_shards", "shard_count"]

# Shards a split is written into: a multiple of 64, so 1, 2, 4, ... 64 processes share them evenly,
# each shard at most this many pictures (WebDataset's advice: shards of 100 MB to a few GB; 1,000 photos is ~100 MB).
_SHARD_GRAIN, _PER_SHARD = 64, 1000


def shard_count(n: int) -> int:
    """Shards for a split of ``n`` pictures: the fewest multiple of 64 that keeps each at 1,000 or fewer (a split of
    fewer than 64 pictures: one shard each)."""
    return min(n, _SHARD_GRAIN * max(1, math.ceil(n / (_SHARD_GRAIN * _PER_SHARD))))


def _spread(n: int, k: int) -> List[range]:
    """``range(n)`` cut into ``k`` runs whose lengths differ by at most one (none empty where ``n >= k``)."""
    cuts = [round(i * n / k) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def write_shards(folder: Union[str, Path], out: Union[str, Path], shards: Optional[int] = None, seed: int = 0,
                 log: Callable[[str], None] = print) -> Path:
    """Write the image folder ``folder`` (``train/`` and ``test/`` or ``val/``, or one folder split 90/10, as
    ``imagefolder:`` reads it) as tar shards in the new folder ``out``, and return ``out``. ``shards``: the training
    split's shard count (default :func:`shard_count`); its pictures are shuffled by ``seed`` first so every shard mixes
    the classes. Written beside ``out`` and renamed when complete: an interrupted write leaves no shards to mistake."""
    wds = webdataset_module()
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} already exists; give a new folder for the shards (nothing is overwritten)")
    ds = load_dataset(f"imagefolder:{folder}", image_size=(64, 64), stream=True)
    for line in ds.notes[1:]:  # the first says how a run would read the folder, which does not apply here
        log(f"note: {line}")
    index = {"format": FORMAT, "source": str(Path(folder).expanduser().resolve()), "classes": list(ds.classes), "mean": list(ds.mean),
             "std": list(ds.std), "fingerprint": ds.fingerprint, "seed": seed}
    plan = {}  # split -> its files, labels and shards' runs, all checked before a byte is written
    for train, split in ((True, "train"), (False, "test")):
        x, y = ds.split(train)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)).tolist() if train else list(range(len(y)))
        k = shards or shard_count(len(y)) if train else math.ceil(len(y) / _PER_SHARD)
        if k > len(y):
            raise DataError(f"{folder}: {k} shards for {len(y)} {split} pictures; ask for {len(y)} or fewer")
        plan[split] = ([x.paths[i] for i in order], [int(y[i]) for i in order], _spread(len(y), k))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for split, (paths, labels, runs) in plan.items():
            index[split] = []
            for s, run in enumerate(runs):
                name = f"{split}-{s:06d}.tar"
                with wds.TarWriter(str(partial / name)) as sink:
                    for i in run:
                        data = Path(paths[i]).read_bytes()
                        aspect_of(data, paths[i])  # its header read: a file that is no picture is refused now, not when a run reaches it
                        ext = Path(paths[i]).suffix.lower().lstrip(".") or "img"
                        sink.write({"__key__": f"{i:08d}", ext: data, "cls": labels[i]})
                index[split].append({"file": name, "labels": labels[run.start : run.stop]})
                if (s + 1) % 64 == 0 or s + 1 == len(runs):
                    log(f"{split}: {s + 1}/{len(runs)} shards written")
        (partial / INDEX).write_text(json.dumps(index))
        if out.exists():
            out.rmdir()
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
