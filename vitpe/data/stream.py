"""Image folders read a batch at a time: memory bounded by the batch and the loader's workers, never by the folder.

The in-memory path (:mod:`vitpe.data.datasets`) decodes every picture before the first step and keeps two copies of
each at the training size: fast on 2 cores at CIFAR scale, about 1 MB a photo at 224 px, so a 24 GB machine holds
some 20,000 photos. Here a folder is a list of files: each picture is decoded when a batch asks for it, upright, and
its crop (RandomResizedCrop's box) is taken from the original and resized once to the batch's size, so a 224-px
fine-tune sees the detail its photos have. :func:`stream_memory` decides between the two paths;
:class:`BatchLoader` runs a run's batches in ``torch.utils.data.DataLoader`` workers ahead of the steps.
"""
from __future__ import annotations

import math
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .images import DataError, open_image, readable, turned

__all__ = ["decode_at", "decode_many", "cache_slot", "DecodedCache", "FolderSplit", "in_memory_bytes", "stream_memory", "StepPlan",
           "BatchLoader", "planned", "sample_stats", "folder_aspects"]

# Bytes the in-memory path holds a picture in, per pixel of the training size: two RGB copies (the square one and one
# at the picture's own aspect ratio), and the decoded picture while it is resized. Measured: 2,000 photos of 640x480
# at 224 px held 2.6 GB at peak, 1.3 MB a photo, 8.6 bytes a pixel.
_BYTES_PER_PIXEL = 9
# The share of the memory available that an in-memory dataset may take; the model, its activations and the loader's
# workers need the rest.
_MEMORY_SHARE = 0.25
_threads = max(1, min(4, os.cpu_count() or 1))  # decode_many's threads in this process (1 in a loader's workers)


def decode_at(path: Union[str, bytes], size: Tuple[int, int], box: Optional[Sequence[float]] = None, name: Optional[str] = None) -> Tensor:
    """One image file (its path, or its bytes: a sample of a tar shard, called ``name`` in errors) as uint8 ``(3, h, w)``
    at ``size = (h, w)``: upright (EXIF), ``box = (x0, y0, w, h)`` in fractions
    of the picture (:func:`~vitpe.data.augment.crop_boxes`; default the whole picture) cut from the original and
    resized in one antialiased bicubic step. A JPEG is decoded only as finely as the box's pixels at ``size`` need."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    bw, bh = (1.0, 1.0) if box is None else (float(box[2]), float(box[3]))
    h, w = size
    rgb = open_image(path, at_least=(w / bw, h / bh), name=name)
    return pil_to_tensor(rgb.resize((w, h), Image.BICUBIC, box=_box_pixels(box, *rgb.size)))


def decode_many(paths: Sequence[Union[str, bytes]], size: Tuple[int, int], boxes: Optional[Tensor] = None,
                names: Optional[Sequence[str]] = None, cache: Optional["DecodedCache"] = None, ids: Optional[Sequence[int]] = None) -> Tensor:
    """:func:`decode_at` for each of ``paths`` (or files' bytes, with their ``names``; ``boxes`` ``(n, 4)`` or None),
    uint8 ``(n, 3, h, w)``, decoded on a few threads: PIL releases the GIL while it decodes and resizes. ``cache``:
    cut from the pictures' slots ``ids`` of a :class:`DecodedCache` instead, decoding only those not yet in it."""
    jobs = list(zip(paths, [None] * len(paths) if boxes is None else boxes.tolist(), names or [None] * len(paths), ids or [None] * len(paths)))

    def one(job: tuple) -> Tensor:
        path, box, name, i = job
        return decode_at(path, size, box, name) if cache is None else cache.cut(i, path, size, box, name)

    if _threads == 1 or len(paths) < 4:
        return torch.stack([one(job) for job in jobs])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(_threads) as pool:
        return torch.stack(list(pool.map(one, jobs)))


def _box_pixels(box: Optional[Sequence[float]], width: int, height: int) -> Tuple[float, float, float, float]:
    """A crop box in fractions (default: the whole picture) as PIL's ``(left, upper, right, lower)`` in pixels."""
    x0, y0, bw, bh = (0.0, 0.0, 1.0, 1.0) if box is None else (float(v) for v in box)
    return x0 * width, y0 * height, (x0 + bw) * width, (y0 + bh) * height


def cache_slot(size: int, crop_scale: Optional[Sequence[float]], crop_ratio: Sequence[float]) -> Tuple[int, int]:
    """The ``(h, w)`` a :class:`DecodedCache` keeps each picture at for a run whose largest size is ``size`` px: the
    smallest crop box :func:`~vitpe.data.augment.crop_boxes` can draw still has as many pixels as the batch shows."""
    if crop_scale is None:
        return size, size
    w, h = math.sqrt(crop_scale[0] * crop_ratio[0]), math.sqrt(crop_scale[0] / crop_ratio[1])
    return math.ceil(size / min(h, 1.0)), math.ceil(size / min(w, 1.0))


class DecodedCache:
    """A split's pictures decoded once, each resized to one ``slot = (h, w)`` (:func:`cache_slot`), in a memory-mapped
    file: a batch's crops are then cut from the slots, a small fraction of a decode's work, and the page cache, not the
    process, holds them. Every cut goes through a slot, the first as well, so a run's pixels do not depend on which
    pictures were cached before (a resume starts an empty cache and reads what an uninterrupted run read). Forked
    loader workers share the file; pictures that two fill at once are written twice with the same bytes."""

    def __init__(self, path: Path, n: int, slot: Tuple[int, int]) -> None:
        self.path, self.slot = Path(path), tuple(slot)
        self.pixels = np.memmap(self.path, np.uint8, "w+", shape=(n, *self.slot, 3))
        self.filled = np.memmap(self.path.with_suffix(".filled"), np.uint8, "w+", shape=(n,))

    @staticmethod
    def nbytes(n: int, slot: Tuple[int, int]) -> int:
        return n * (slot[0] * slot[1] * 3 + 1)

    def cut(self, i: int, source: Union[str, bytes], size: Tuple[int, int], box: Optional[Sequence[float]] = None,
            name: Optional[str] = None) -> Tensor:
        """Picture ``i`` (decoded from ``source`` the first time) at ``size``, its ``box`` cut from its slot and resized once."""
        from PIL import Image
        from torchvision.transforms.functional import pil_to_tensor

        h, w = self.slot
        if not self.filled[i]:
            self.pixels[i] = decode_at(source, self.slot, None, name).permute(1, 2, 0).numpy()
            self.filled[i] = 1  # after the pixels: a reader that sees the flag sees them
        picture = Image.fromarray(np.asarray(self.pixels[i]))
        return pil_to_tensor(picture.resize(size[::-1], Image.BICUBIC, box=_box_pixels(box, w, h)))

    def close(self) -> None:
        """Delete the files (the mapping goes with the last reference to it)."""
        for path in (self.path, self.path.with_suffix(".filled")):
            path.unlink(missing_ok=True)


@dataclass
class FolderSplit:
    """A split of an image folder at one size, decoded when a part of it is asked for (``split[a:b]``, ``split[index]``):
    what :meth:`~vitpe.data.datasets.ImageDataset.split` gives for a streamed folder, so evaluation reads it batch by
    batch as it reads a tensor."""

    paths: List[str]
    size: Tuple[int, int]

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (len(self.paths), 3, *self.size)

    def __getitem__(self, part: Union[slice, Tensor, Sequence[int]]) -> Tensor:
        index = range(len(self.paths))[part] if isinstance(part, slice) else (part.tolist() if isinstance(part, Tensor) else list(part))
        return decode_many([self.paths[i] for i in index], self.size)


def in_memory_bytes(n_images: int, size: Tuple[int, int]) -> int:
    """What the in-memory path would hold for ``n_images`` pictures at ``size``."""
    return n_images * size[0] * size[1] * _BYTES_PER_PIXEL


def stream_memory(n_images: int, size: Tuple[int, int], available: int) -> bool:
    """Whether a folder of ``n_images`` at ``size`` is read a batch at a time: when holding it would take more than a
    quarter of the ``available`` bytes."""
    return in_memory_bytes(n_images, size) > _MEMORY_SHARE * available


# ---- batches ahead of the steps ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPlan:
    """What a training step reads, decided by the run's seeded draws before any image is decoded: the split's samples,
    the size, and each sample's crop box (or None)."""

    step: int
    index: Tensor
    size: Tuple[int, int]
    boxes: Optional[Tensor]


class _Plans(torch.utils.data.Dataset):
    """A DataLoader dataset whose items are whole batches: ``plan -> (step, images)``."""

    def __init__(self, decode: Callable[[StepPlan], Tensor]) -> None:
        self.decode = decode

    def __getitem__(self, plan: StepPlan) -> Tuple[int, Union[Tensor, DataError]]:
        try:
            return plan.step, self.decode(plan)
        except DataError as e:  # said in the run's own words, not as a worker's traceback
            return plan.step, e


class _Sampler(torch.utils.data.Sampler):
    def __init__(self, plans: Iterator[StepPlan]) -> None:
        self.plans = plans

    def __iter__(self) -> Iterator[StepPlan]:
        return self.plans


def _worker_init(_: int) -> None:
    global _threads
    _threads = 1  # a worker is one of several processes: its decoding is serial
    # Ctrl-C reaches the whole process group: the training process stops the run at a step boundary, and its loader
    # stops the workers then; a worker that ran the training process's handler would speak for it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


class BatchLoader:
    """The images of steps ``first`` to ``last - 1``, ``decode(plan(step))`` run by ``workers`` DataLoader processes ahead
    of the steps (two batches each in flight). ``plan(step)`` must be a pure function of the step (the run's seeded
    draws, :func:`planned`): the loader calls it ahead of time, so a resumed run reads exactly what an uninterrupted
    one would. Forked workers inherit the dataset: nothing but the plans and the images is sent between processes.
    :meth:`over` runs a stream of ``(step, batch)`` instead (tar shards, :mod:`vitpe.data.shards`)."""

    def __init__(self, decode: Callable[[StepPlan], Tensor], plan: Callable[[int], StepPlan], first: int, last: int, workers: int) -> None:
        self._start(_Plans(decode), _Sampler(plan(s) for s in range(first, last)), workers)

    @classmethod
    def over(cls, batches: torch.utils.data.IterableDataset, workers: int) -> "BatchLoader":
        """A loader of ``batches``, an iterable of ``(step, batch or DataError)`` whose copies in ``workers`` processes
        take turns, one step each (``torch.utils.data.get_worker_info`` tells a copy its turn); 0: read here."""
        loader = cls.__new__(cls)
        loader._start(batches, None, workers)
        return loader

    def _start(self, dataset: torch.utils.data.Dataset, sampler: Optional[torch.utils.data.Sampler], workers: int) -> None:
        fork = "fork" in _contexts()
        more = dict(prefetch_factor=2, worker_init_fn=_worker_init, multiprocessing_context="fork" if fork else None) if workers else {}
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers, **more)
        self.it = iter(self.loader)

    def images(self, step: int):
        """Step ``step``'s batch: its images (or, from :meth:`over`, what the stream gives for it)."""
        got, x = next(self.it)
        if got != step:
            raise RuntimeError(f"the data loader gave step {got}'s images for step {step}")  # a bug, never the user's input
        if isinstance(x, DataError):
            raise x
        return x

    def close(self) -> None:
        del self.it  # its workers stop


def _contexts() -> List[str]:
    import multiprocessing

    return multiprocessing.get_all_start_methods()


def planned(draw: Callable[[int], StepPlan]) -> Callable[[int], StepPlan]:
    """``draw`` run with the global generators (torch's, Python's, NumPy's) saved and restored: the loader plans steps
    ahead while the current step's augmentation is still drawing from them."""

    def plan(step: int) -> StepPlan:
        python, numpy = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                return draw(step)
        finally:
            random.setstate(python)
            np.random.set_state(numpy)

    return plan


def sample_stats(paths: Sequence[str], k: int = 256) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Per-channel mean and std (fractions of 255) of ``k`` pictures spread evenly over ``paths``, decoded at 64 px: a
    folder of any size is normalised from a fixed amount of decoding."""
    m = min(k, len(paths))
    pick = [paths[round(i * (len(paths) - 1) / max(m - 1, 1))] for i in range(m)]
    x = decode_many(pick, (64, 64)).float() / 255
    return tuple(x.mean((0, 2, 3)).tolist()), tuple(x.std((0, 2, 3)).clamp_min(1e-3).tolist())


def aspect_of(path: Union[str, bytes], name: Optional[str] = None) -> float:
    """Width / height of the upright picture, from the file's header (nothing decoded); ``path`` may be the file's bytes,
    called ``name`` in errors."""
    from PIL import Image

    try:
        with Image.open(readable(path)) as im:
            w, h = im.size[::-1] if turned(im) else im.size
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read image {path if name is None else name} ({type(e).__name__}: {str(e)[:80]}); remove or replace it") from None
    return w / h


def folder_aspects(paths: Sequence[str]) -> Tensor:
    return torch.tensor([aspect_of(p) for p in paths])

