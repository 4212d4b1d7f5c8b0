"""Image folders read a batch at a time: memory bounded by the batch and the loader's workers, never by the folder.

The in-memory path (:mod:`vitpe.data.datasets`) decodes every picture before the first step and keeps two copies of
each at the training size: fast on 2 cores at CIFAR scale, about 1 MB a photo at 224 px, so a 24 GB machine holds
some 20,000 photos. Here a folder is a list of files: each picture is decoded when a batch asks for it, upright, and
its crop (RandomResizedCrop's box) is taken from the original and resized once to the batch's size, so a 224-px
fine-tune sees the detail its photos have. :func:`stream_memory` decides between the two paths;
:class:`BatchLoader` runs a run's batches in ``torch.utils.data.DataLoader`` workers ahead of the steps.
"""
from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .images import DataError, open_image, turned

__all__ = ["decode_at", "decode_many", "FolderSplit", "in_memory_bytes", "stream_memory", "StepPlan", "BatchLoader", "planned", "sample_stats",
           "folder_aspects"]

# Bytes the in-memory path holds a picture in, per pixel of the training size: two RGB copies (the square one and one
# at the picture's own aspect ratio), and the decoded picture while it is resized. Measured: 2,000 photos of 640x480
# at 224 px held 2.6 GB at peak, 1.3 MB a photo, 8.6 bytes a pixel.
_BYTES_PER_PIXEL = 9
# The share of the memory available that an in-memory dataset may take; the model, its activations and the loader's
# workers need the rest.
_MEMORY_SHARE = 0.25
_threads = max(1, min(4, os.cpu_count() or 1))  # decode_many's threads in this process (1 in a loader's workers)


def decode_at(path: str, size: Tuple[int, int], box: Optional[Sequence[float]] = None) -> Tensor:
    """One image file as uint8 ``(3, h, w)`` at ``size = (h, w)``: upright (EXIF), ``box = (x0, y0, w, h)`` in fractions
    of the picture (:func:`~vitpe.data.augment.crop_boxes`; default the whole picture) cut from the original and
    resized in one antialiased bicubic step. A JPEG is decoded only as finely as the box's pixels at ``size`` need."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    x0, y0, bw, bh = (0.0, 0.0, 1.0, 1.0) if box is None else (float(v) for v in box)
    h, w = size
    rgb = open_image(path, at_least=(w / bw, h / bh))
    W, H = rgb.size
    return pil_to_tensor(rgb.resize((w, h), Image.BICUBIC, box=(x0 * W, y0 * H, (x0 + bw) * W, (y0 + bh) * H)))


def decode_many(paths: Sequence[str], size: Tuple[int, int], boxes: Optional[Tensor] = None) -> Tensor:
    """:func:`decode_at` for each of ``paths`` (``boxes`` ``(n, 4)`` or None), uint8 ``(n, 3, h, w)``, decoded on a few
    threads: PIL releases the GIL while it decodes and resizes."""
    rows = [None] * len(paths) if boxes is None else boxes.tolist()
    if _threads == 1 or len(paths) < 4:
        return torch.stack([decode_at(p, size, b) for p, b in zip(paths, rows)])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(_threads) as pool:
        return torch.stack(list(pool.map(lambda pb: decode_at(pb[0], size, pb[1]), zip(paths, rows))))


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
    one would. Forked workers inherit the dataset: nothing but the plans and the images is sent between processes."""

    def __init__(self, decode: Callable[[StepPlan], Tensor], plan: Callable[[int], StepPlan], first: int, last: int, workers: int) -> None:
        fork = "fork" in _contexts()
        self.loader = torch.utils.data.DataLoader(_Plans(decode), batch_size=None, sampler=_Sampler(plan(s) for s in range(first, last)),
                                                  num_workers=workers, prefetch_factor=2, worker_init_fn=_worker_init,
                                                  multiprocessing_context="fork" if fork else None)
        self.it = iter(self.loader)

    def images(self, step: int) -> Tensor:
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


def aspect_of(path: str) -> float:
    """Width / height of the upright picture, from the file's header (nothing decoded)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size[::-1] if turned(im) else im.size
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"cannot read image {path} ({type(e).__name__}: {str(e)[:80]}); remove or replace it") from None
    return w / h


def folder_aspects(paths: Sequence[str]) -> Tensor:
    return torch.tensor([aspect_of(p) for p in paths])

