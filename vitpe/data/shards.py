"""Image folders as tar shards, WebDataset's format, for training on many processes and machines.

A folder is written once (:func:`vitpe.data.shard_writer.write_shards`) as the files' own bytes in
``train-NNNNNN.tar`` and ``test-NNNNNN.tar`` with ``shards.json`` (classes, labels, mean and std, the training set's
fingerprint). The ``webdataset`` library reads them (:class:`ShardBatches`): every epoch the shards are put in an order
drawn from the run's seed and process ``r`` of ``P`` reads shards ``r, r + P, ...`` of it, its own: no picture is read
by two machines. Each sample is decoded once, upright, with its crop cut from the original
(:func:`~vitpe.data.stream.decode_at`), at the step's size and boxes drawn from the step's seed. A resumed run counts
past the samples it already trained on without decoding them, so it reads exactly what an uninterrupted run reads.
"""
from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .images import DataError
from .stream import DecodedCache, StepPlan, decode_many

__all__ = ["INDEX", "FORMAT", "webdataset_module", "ShardIndex", "read_index", "ShardSplit", "ShardBatches", "shard_order"]

INDEX = "shards.json"
FORMAT = "vitpe-shards/1"
# Samples a reader holds to shuffle (webdataset's default): with the shards' order drawn each epoch and the pictures
# shuffled when written, a batch mixes classes and shards.
_SHUFFLE_BUFFER = 1000


def webdataset_module():
    """The ``webdataset`` package, or a one-line :class:`DataError` saying how to install it."""
    try:
        import webdataset
    except ImportError:
        raise DataError("tar shards need the webdataset package: pip install 'vitpe[shards]' (or pip install webdataset)") from None
    return webdataset


@dataclass(frozen=True)
class ShardIndex:
    """``shards.json``: the folder's classes, mean and std, fingerprint, and each split's shard files with their labels."""

    root: Path
    classes: Tuple[str, ...]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    fingerprint: Optional[str]
    files: Dict[bool, Tuple[str, ...]]  # train -> shard paths, in the order written
    labels: Dict[bool, Tuple[Tuple[int, ...], ...]]  # train -> each shard's labels, in the order its samples come

    def split_labels(self, train: bool) -> Tensor:
        return torch.tensor([c for shard in self.labels[train] for c in shard], dtype=torch.long)


def read_index(root: Path) -> ShardIndex:
    """The shards in folder ``root``, checked: one-line :class:`DataError` for a folder without them or a shard missing."""
    path = root / INDEX
    if not path.is_file():
        raise DataError(f"{root} has no {INDEX}; write an image folder as shards with: vitpe shards FOLDER {root}")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise DataError(f"{path} is not a vitpe shard index ({FORMAT}); write the shards again with vitpe shards")
    files = {t: tuple(str(root / r["file"]) for r in meta[k]) for t, k in ((True, "train"), (False, "test"))}
    missing = [f for fs in files.values() for f in fs if not os.path.isfile(f)]
    if missing:
        raise DataError(f"{root}: {len(missing)} of the shards {INDEX} lists are missing (e.g. {Path(missing[0]).name}); copy them all")
    labels = {t: tuple(tuple(r["labels"]) for r in meta[k]) for t, k in ((True, "train"), (False, "test"))}
    return ShardIndex(root, tuple(meta["classes"]), tuple(meta["mean"]), tuple(meta["std"]), meta.get("fingerprint"), files, labels)


def _samples(files: List[str]) -> Iterator[dict]:
    """The raw samples (the file's bytes, undecoded) of ``files`` in order, read by webdataset."""
    wds = webdataset_module()
    if files:
        yield from wds.WebDataset(files, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False)


def _picture(sample: dict) -> Tuple[bytes, int, str]:
    """A sample's image bytes, label and name (``shard:key``, for errors)."""
    ext = next(k for k in sample if not k.startswith("__") and k != "cls")
    return sample[ext], int(sample["cls"]), f"{Path(sample['__url__']).name}:{sample['__key__']}.{ext}"


def _decode(samples: List[dict], size: Tuple[int, int], boxes: Optional[Tensor], cache: Optional[DecodedCache] = None) -> Tuple[Tensor, Tensor]:
    pictures = [_picture(s) for s in samples]
    ids = [int(s["__key__"]) for s in samples] if cache is not None else None  # a sample's key is its place in the split
    x = decode_many([p[0] for p in pictures], size, boxes, [p[2] for p in pictures], cache, ids)
    return x, torch.tensor([p[1] for p in pictures], dtype=torch.long)


@dataclass
class ShardSplit:
    """A split's shards read in order at one size (evaluation's ``split[a:b]``, slice after slice): a slice that does
    not go on from the last starts the read again."""

    files: List[str]
    size: Tuple[int, int]
    n: int

    def __post_init__(self) -> None:
        self._it, self._at = None, 0

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (self.n, 3, *self.size)

    def __getitem__(self, part: slice) -> Tensor:
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise DataError("a split read from tar shards is read in order, a slice at a time; read the image folder for random access")
        index = range(self.n)[part]
        if self._it is None or index.start != self._at:
            self._it, self._at = _samples(self.files), 0
            for _ in range(index.start):
                next(self._it)
        samples = [next(self._it) for _ in index]
        self._at = index.stop
        return _decode(samples, self.size, None)[0]


def shard_order(n_shards: int, seed: int, epoch: int) -> List[int]:
    """The epoch's order of the training shards, the same on every process."""
    return torch.randperm(n_shards, generator=torch.Generator().manual_seed(seed * 7919 + epoch + 1)).tolist()


class ShardBatches(torch.utils.data.IterableDataset):
    """This process's training batches for steps ``first`` to ``last - 1`` of ``epoch``, as ``(step, (images, labels))``
    (or ``(step, DataError)``), from its own shards.

    Process ``rank`` of ``world`` reads the epoch's shards ``rank::world`` (:func:`shard_order`) through a buffer
    shuffled by the seed; step ``k`` trains on samples ``k * per_rank`` to ``(k + 1) * per_rank`` of that stream. A
    loader's workers take turns, one step each: each reads the stream and decodes only its own steps' pictures, so the
    batches are the same whatever the number of workers, and a resumed run counts past the samples it trained on
    without decoding them. ``plan(step)`` gives the step's size and crop boxes for the whole batch; this process's are
    ``mine``. Should the process's shards run out before the epoch's steps do, they are read again. ``cache``: cut
    the pictures from their slots (by their keys) in a :class:`~vitpe.data.stream.DecodedCache`."""

    def __init__(self, index: ShardIndex, plan: Callable[[int], StepPlan], mine: slice, first: int, last: int, epoch: int,
                 rank: int, world: int, per_rank: int, seed: int, cache: Optional[DecodedCache] = None) -> None:
        self.plan, self.mine, self.first, self.last, self.per_rank, self.cache = plan, mine, first, last, per_rank, cache
        self.key = f"{seed}/{epoch}/{rank}"
        files = index.files[True]
        if len(files) < world:
            raise DataError(f"{index.root} has {len(files)} training shards for {world} processes, which need one each at least; "
                            "write more (vitpe shards --shards N)")
        self.mine_shards = [files[i] for i in shard_order(len(files), seed, epoch)[rank::world]]

    def stream(self) -> Iterator[dict]:
        """This process's raw samples for the epoch, undecoded: its shards through a seeded shuffle buffer, again and
        again."""
        wds = webdataset_module()
        for again in itertools.count():
            rng = random.Random(f"{self.key}/{again}")  # a string seeds Python's generator the same in every process
            yield from wds.filters.shuffle(_SHUFFLE_BUFFER, rng=rng)(_samples(self.mine_shards))

    def __iter__(self) -> Iterator[Tuple[int, Union[Tuple[Tensor, Tensor], DataError]]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        samples, at = self.stream(), 0
        for step in range(self.first + worker, self.last, workers):
            for _ in range(step * self.per_rank - at):  # the steps of other workers, or trained before a resume: counted, not decoded
                next(samples)
            batch = [next(samples) for _ in range(self.per_rank)]
            at = (step + 1) * self.per_rank
            plan = self.plan(step)
            try:
                yield step, _decode(batch, plan.size, None if plan.boxes is None else plan.boxes[self.mine], self.cache)
            except DataError as e:  # said in the run's own words, not as a worker's traceback
                yield step, e
