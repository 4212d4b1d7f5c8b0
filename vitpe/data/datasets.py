"""Datasets behind one small interface: whole splits as uint8 tensors in memory.

At CIFAR scale a split fits in memory (CIFAR-10 train: 150 MB), and batch-level tensor operations on
it are far faster on 2 CPU cores than per-image PIL pipelines. ``load_dataset(name)`` gives an
:class:`ImageDataset`; ``.split(train, size)`` gives ``(images (N, C, H, W) uint8, labels (N,))`` at
the requested resolution: rendered natively for ``shapes``, resized (antialiased) for the rest.
"""
from __future__ import annotations

import gzip
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..suggest import did_you_mean
from .augment import crop_resize
from .gratings import GRATINGS_CLASSES, gratings_params, render_gratings, zoomed_gratings
from .images import DataError, FolderImages, digest_of, drop_copies_of, read_folder
from .shapes import POSITION_CLASSES, SHAPES_CLASSES, render_shapes, shapes_params, zoomed

__all__ = ["DataError", "ImageDataset", "load_dataset", "resize_images", "shrink_to", "area_weights", "DEBIAN_FASHION_MNIST", "SHAPES_SEED", "TRAIN_SIZES"]

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
_FMNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def resize_images(images: Tensor, size: Tuple[int, int]) -> Tensor:
    """uint8 ``(N, C, H, W)`` -> uint8 at ``size``, bilinear with antialiasing (area-like when shrinking)."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    out = []
    for chunk in images.split(2048):
        out.append(F.interpolate(chunk.float(), size=size, mode="bilinear", antialias=True, align_corners=False).round().clamp(0, 255).to(torch.uint8))
    return torch.cat(out)


def area_weights(n_in: int, n_out: int) -> Tensor:
    """``(n_out, n_in)``: each output pixel the exact mean of the input pixels it covers, weighted by the length each
    covers (a box filter, OpenCV's INTER_AREA). Shrinking a natively rendered ``2n``-px image to ``n`` px this way gives
    the ``n``-px rendering itself, as a sensor of that size would see the scene."""
    edges_out = torch.arange(n_out + 1, dtype=torch.float64) * (n_in / n_out)
    lo = torch.maximum(edges_out[:-1, None], torch.arange(n_in, dtype=torch.float64)[None])
    hi = torch.minimum(edges_out[1:, None], torch.arange(1, n_in + 1, dtype=torch.float64)[None])
    return ((hi - lo).clamp_min(0) * (n_out / n_in)).float()


def shrink_to(images: Tensor, size: Tuple[int, int]) -> Tensor:
    """uint8 ``(N, C, H, W)`` -> uint8 at ``size``: an exact area average along each axis that shrinks (see
    :func:`area_weights`), then :func:`resize_images` along an axis that grows (a 24x44 image brought to 32x32 is
    averaged across and stretched down). The resize route of ``eval.py`` uses it: the baseline a larger image must beat
    is that image brought back to the training size losing nothing a smaller capture keeps."""
    (h, w), (oh, ow) = images.shape[-2:], size
    x = images.float()
    if oh < h:
        x = torch.einsum("oh,nchw->ncow", area_weights(h, oh), x)
    if ow < w:
        x = torch.einsum("pw,nchw->nchp", area_weights(w, ow), x)
    return resize_images(x.round().clamp(0, 255).to(torch.uint8), size)  # the axes left to grow, if any


@dataclass
class ImageDataset:
    """A dataset's splits and what a model needs to know about it."""

    name: str
    classes: Tuple[str, ...]
    in_chans: int
    native_size: Tuple[int, int]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    flip_ok: bool  # horizontal flips keep labels (not for shapes: "left of" classes)
    renders_natively: bool
    _load: Callable[[bool, Tuple[int, int]], Tuple[Tensor, Tensor]] = field(repr=False, default=None)
    _cache: Dict = field(repr=False, default_factory=dict)
    _pick: Optional[Callable[[bool, Tensor, Tuple[int, int]], Tensor]] = field(repr=False, default=None)
    _pick_zoomed: Optional[Callable[[bool, Tensor, Tuple[int, int], Tensor], Tensor]] = field(repr=False, default=None)
    _aspects: Dict[bool, Tensor] = field(repr=False, default_factory=dict)
    # Classes that hold the same content and differ only in where it is: a model without position cannot tell them apart.
    position_classes: Tuple[int, ...] = ()
    notes: Tuple[str, ...] = ()  # what loading skipped or changed and why, one line each (the command lines print them)
    fingerprint: Optional[str] = None  # which training images, with which labels (an image folder's; a checkpoint keeps it)
    # Read a batch at a time from files (vitpe.data.stream): a split is a FolderSplit, decoded as it is indexed.
    streamed: bool = False
    shards: Optional[Any] = field(repr=False, default=None)  # a vitpe.data.shards.ShardIndex: read in order from tar shards
    _caches: Dict[bool, Any] = field(repr=False, default_factory=dict)  # split -> its vitpe.data.stream.DecodedCache
    _measure_aspects: Optional[Callable[[bool], Tensor]] = field(repr=False, default=None)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def split(self, train: bool, size: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor]:
        """``(images uint8 (N, C, H, W), labels int64 (N,))`` of the train or test split at ``size``."""
        size = tuple(size or self.native_size)
        key = (train, size)
        if key not in self._cache:
            if self.renders_natively or self.streamed:
                self._cache[key] = self._load(train, size)
            else:
                native = self._cache.get((train, tuple(self.native_size))) or self._load(train, tuple(self.native_size))
                self._cache[(train, tuple(self.native_size))] = native
                self._cache[key] = (resize_images(native[0], size), native[1])
        return self._cache[key]

    def split_at(self, train: bool, size: Tuple[int, int], max_bytes: int = 2**30) -> Tuple[Union[Tensor, "LazySplit"], Tensor]:
        """:meth:`split` at ``size``, or, where the whole split at that size would take more than ``max_bytes``, images
        made a slice at a time as they are indexed (the same pixels; nothing kept): memory stays bounded at any size."""
        labels = self.split(train)[1]
        if self.streamed or len(labels) * self.in_chans * size[0] * size[1] <= max_bytes:  # a streamed split is made as indexed
            return self.split(train, size)
        return LazySplit(self, train, tuple(size), len(labels)), labels

    def images_at(self, train: bool, index: Tensor, size: Tuple[int, int], boxes: Optional[Tensor] = None) -> Tensor:
        """Samples ``index`` of a split at ``size = (h, w)``, uint8 ``(n, C, h, w)``: shapes renders them there, an image
        folder resizes each from its own copy (its aspect ratio kept), the rest resize the stored split. ``boxes``
        ``(n, 4)`` (:func:`~vitpe.data.augment.crop_boxes`): each sample's box fills the image instead (content scale
        augmentation), rendered at that scale where the data renders natively (square boxes), else cropped from the
        stored image and resized once."""
        if boxes is None:
            if self._pick is not None:
                return self._pick(train, index, tuple(size))
            return resize_images(self.split(train)[0][index], tuple(size))
        if self._pick_zoomed is not None:
            return self._pick_zoomed(train, index, tuple(size), boxes)
        source = self._pick(train, index, tuple(size)) if self._pick is not None else self.split(train)[0][index]
        return crop_resize(source, boxes, size)

    def aspects(self, train: bool) -> Optional[Tensor]:
        """Width / height of each sample of a split, when they differ (an image folder: the aspect ratio of the copy
        it keeps, the file's own to a pixel); None when every sample has the dataset's native size."""
        if train not in self._aspects and self._measure_aspects is not None:  # a streamed folder reads its files' headers once
            self._aspects[train] = self._measure_aspects(train)
        return self._aspects.get(train)

    def keep_decoded(self, train: bool, cache: Any) -> None:
        """Cut a streamed split's pictures from ``cache`` (:class:`~vitpe.data.stream.DecodedCache`), each decoded
        from its file only the first time."""
        if not self.streamed:
            raise ValueError(f"{self.name} is held in memory: it has no decoding to keep")
        self._caches[train] = cache

    def decoded(self, train: bool) -> Any:
        """The split's :class:`~vitpe.data.stream.DecodedCache`, or None."""
        return self._caches.get(train)

    def describe(self) -> Dict:
        return {"name": self.name, "classes": list(self.classes), "in_chans": self.in_chans, "native_size": list(self.native_size),
                "mean": list(self.mean), "std": list(self.std), **({"fingerprint": self.fingerprint} if self.fingerprint else {}),
                **({"streamed": True} if self.streamed else {})}


@dataclass
class LazySplit:
    """A split at one size whose images are made when a slice of them is asked for (:meth:`ImageDataset.split_at`)."""

    ds: ImageDataset
    train: bool
    size: Tuple[int, int]
    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, part: slice) -> Tensor:
        index = torch.arange(self.n)[part]
        if self.ds.renders_natively:
            return self.ds._pick(self.train, index, self.size)
        return resize_images(self.ds.split(self.train)[0][index], self.size)


# Training images of each built-in dataset when data.train_size does not choose (what a recipe's epochs are counted in).
TRAIN_SIZES = {"shapes": 20000, "gratings": 20000, "fashion_mnist": 60000, "cifar10": 50000, "cifar100": 50000}


def _subset(x: Tensor, y: Tensor, n: Optional[int]) -> Tuple[Tensor, Tensor]:
    return (x, y) if n is None or n >= len(y) else (x[:n], y[:n])


# ---- shapes ----------------------------------------------------------------------------------------
SHAPES_SEED = {True: 0, False: 1}  # the train and test splits' seeds: every run and every resolution sees the same samples


def _rendered(name: str, classes: Tuple[str, ...], n: Dict[bool, int], params_fn: Callable[[int, int], dict],
              render: Callable[[dict, Tuple[int, int]], Tensor], zoom: Callable[[dict, Tensor], dict], std: float, flip_ok: bool,
              **kw) -> ImageDataset:
    """A dataset drawn from continuous parameters (``params_fn(n, seed)``), rendered natively at every size asked for:
    whole splits, chosen samples, or samples zoomed into boxes (content scale augmentation, rendered at the new scale)."""
    params = {}

    def params_of(train: bool) -> dict:
        if train not in params:
            params[train] = params_fn(n[train], SHAPES_SEED[train])
        return params[train]

    def chosen(train: bool, index: Tensor) -> dict:
        return {k: v[index] for k, v in params_of(train).items()}

    def load(train: bool, size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        return render(params_of(train), size), params_of(train)["label"].clone()

    return ImageDataset(name, classes, 3, (32, 32), (0.5, 0.5, 0.5), (std,) * 3, flip_ok, True, load,
                        _pick=lambda train, index, size: render(chosen(train, index), size),
                        _pick_zoomed=lambda train, index, size, boxes: render(zoom(chosen(train, index), boxes), size), **kw)


def _shapes(data_dir: Path, train_size: Optional[int], test_size: Optional[int]) -> ImageDataset:
    n = {True: train_size or TRAIN_SIZES["shapes"], False: test_size or 5000}
    return _rendered("shapes", SHAPES_CLASSES, n, lambda k, seed: shapes_params(k, seed=seed), render_shapes, zoomed, 0.28, False,
                     position_classes=POSITION_CLASSES)


def _gratings(train_size: Optional[int], test_size: Optional[int]) -> ImageDataset:
    n = {True: train_size or TRAIN_SIZES["gratings"], False: test_size or 5000}
    return _rendered("gratings", GRATINGS_CLASSES, n, gratings_params, render_gratings, zoomed_gratings, 0.25, True)


# ---- Fashion-MNIST ---------------------------------------------------------------------------------
FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


def _stage_file(src: Path, dest: Path) -> None:
    """Copy ``src`` (or decompress ``src.gz``) to ``dest`` through a temporary of its own, renamed into place: study
    processes started together stage the same files at once, and none may see or remove another's half-written copy."""
    gz = not src.is_file()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fout, (gzip.open(f"{src}.gz", "rb") if gz else open(src, "rb")) as fin:
            shutil.copyfileobj(fin, fout)
        os.replace(tmp, dest)
    except (OSError, EOFError) as e:
        if not gz:
            raise
        raise DataError(f"Fashion-MNIST file {src}.gz is corrupt ({e}); delete it and get a fresh copy") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def _stage_fashion_mnist(data_dir: Path) -> None:
    """Put the raw IDX files where torchvision's FashionMNIST looks (``DATA_DIR/FashionMNIST/raw``),
    taking them from DATA_DIR itself, from Debian's dataset-fashion-mnist package, or a download."""
    raw = data_dir / "FashionMNIST" / "raw"
    if all((raw / f).is_file() for f in _FMNIST_FILES):
        return
    for src in (data_dir, data_dir / "fashion-mnist", raw, DEBIAN_FASHION_MNIST):
        if all((src / f).is_file() or (src / f"{f}.gz").is_file() for f in _FMNIST_FILES):
            raw.mkdir(parents=True, exist_ok=True)
            for f in _FMNIST_FILES:
                if not ((src / f).is_file() and (src / f).resolve() == (raw / f).resolve()):
                    _stage_file(src / f, raw / f)
            return
    try:
        from torchvision.datasets import FashionMNIST

        FashionMNIST(str(data_dir), train=True, download=True)
        FashionMNIST(str(data_dir), train=False, download=True)
    except Exception as e:  # offline: URLError, socket errors, HTTP errors...
        raise DataError(
            f"Fashion-MNIST not found in {data_dir} and could not be downloaded ({type(e).__name__}). Get it one of three ways: "
            f"(1) --data-dir DIR with the four IDX files (.gz or raw); (2) apt-get install dataset-fashion-mnist "
            f"(installs {DEBIAN_FASHION_MNIST}); (3) run once with internet access to download it"
        ) from None


def _fashion_mnist(data_dir: Path, train_size: Optional[int], test_size: Optional[int]) -> ImageDataset:
    from torchvision.datasets import FashionMNIST

    _stage_fashion_mnist(data_dir)

    def load(train: bool, size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        try:
            ds = FashionMNIST(str(data_dir), train=train, download=False)
        except (RuntimeError, ValueError, AssertionError) as e:
            raise DataError(f"Fashion-MNIST files in {data_dir / 'FashionMNIST' / 'raw'} are corrupt ({e}); delete them and get fresh copies") from None
        x, y = ds.data.unsqueeze(1).contiguous(), ds.targets.long()
        return _subset(x, y, train_size if train else test_size)

    return ImageDataset("fashion_mnist", FMNIST_CLASSES, 1, (28, 28), (0.2860,), (0.3530,), True, False, load)


# ---- CIFAR -----------------------------------------------------------------------------------------
def _cifar(name: str, data_dir: Path, train_size: Optional[int], test_size: Optional[int]) -> ImageDataset:
    import torchvision.datasets as tvd

    base = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100

    folder = data_dir / base.base_folder

    def present() -> bool:
        return all((folder / f).is_file() for f, _ in base.train_list + base.test_list + [(base.meta["filename"], None)])

    class _Cifar(base):
        # torchvision checks MD5 sums of the full official archive; we check presence and let a broken
        # pickle fail with a clear message instead, so small files in CIFAR's own format load too.
        def _check_integrity(self) -> bool:
            return present()

        def _load_meta(self) -> None:  # torchvision's also checks the official MD5
            with open(folder / self.meta["filename"], "rb") as f:
                meta = pickle.load(f, encoding="latin1")
            self.classes = meta[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    if not present():
        try:
            base(str(data_dir), train=True, download=True)
        except Exception as e:
            raise DataError(
                f"{name} not found in {folder} and could not be downloaded ({type(e).__name__}); "
                f"put the extracted '{base.base_folder}' folder under --data-dir, or run once with internet access"
            ) from None

    meta: Dict[str, Tuple[str, ...]] = {}

    def load(train: bool, size: Tuple[int, int]) -> Tuple[Tensor, Tensor]:
        try:
            ds = _Cifar(str(data_dir), train=train, download=False)
        except Exception as e:  # unpickling errors come in many types
            raise DataError(f"{name} files in {folder} are corrupt or not in CIFAR format ({type(e).__name__}: {e}); replace them") from None
        meta["classes"] = tuple(ds.classes)
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        return _subset(x, torch.tensor(ds.targets, dtype=torch.long), train_size if train else test_size)

    test = load(False, (32, 32))  # reads the meta file too, so a broken copy fails now, not mid-run
    classes = meta["classes"]
    ds = ImageDataset(name, classes, 3, (32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, False, load)
    ds._cache[(False, (32, 32))] = test
    return ds


# ---- imagefolder -----------------------------------------------------------------------------------
def _imagefolder(root: Path, train_size: Optional[int], test_size: Optional[int], size: Tuple[int, int] = (32, 32),
                 stream: Optional[bool] = None, memory: Optional[int] = None) -> ImageDataset:
    """Class-per-folder images (:func:`vitpe.data.images.read_folder`: each picture once, upright). ``root/train`` and
    ``root/test`` (or ``val``) if present, else a fixed 90/10 split of ``root``; either way no test image is a copy of a
    training image. Held in memory, images are converted to RGB and resized to ``size``; each also keeps a copy of
    ``size``'s area at its own aspect ratio, for training and evaluation at native aspect ratio (packed). ``stream``:
    read a batch at a time instead (:mod:`vitpe.data.stream`); None chooses, from the folder's size and ``memory`` (bytes
    available; default: what the machine has free), and the first note says which and why."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    from .images import scan_folder
    from .memory import gib, host_memory_available
    from .stream import in_memory_bytes, stream_memory

    if not root.is_dir():
        raise DataError(f"imagefolder path {root} is not a directory; give imagefolder:PATH with one sub-folder per class")
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    has_split = (root / "train").is_dir() and test_dir is not None
    area = size[0] * size[1]
    scans = [scan_folder(d) for d in ((root / "train", test_dir) if has_split else (root,))]  # read_folder takes them: one scan
    n_files = sum(len(scan.paths) for scan in scans)
    memory = host_memory_available() if memory is None else memory
    need = f"about {gib(in_memory_bytes(n_files, size))} of the {gib(memory)} available"
    held = f"held in memory they take {need}"
    if stream is None:
        stream = stream_memory(n_files, size, memory)
        how = (f"read a batch at a time ({held}; data.stream=false holds them)" if stream
               else f"held in memory ({need}; data.stream=true reads them a batch at a time)")
    else:
        how = f"read a batch at a time (data.stream=true; {held})" if stream else "held in memory (data.stream=false)"
    first_note = f"imagefolder {root}: {n_files:,} image files, {how}"

    def decode(rgb) -> Tuple[Tensor, Tensor]:
        a = rgb.width / rgb.height
        own = (max(1, round((area * a) ** 0.5)), max(1, round((area / a) ** 0.5)))
        return pil_to_tensor(rgb.resize(size[::-1], Image.BICUBIC)), pil_to_tensor(rgb.resize(own, Image.BICUBIC))

    if has_split:
        parts = {True: read_folder(scans[0], decode, by_bytes=stream), False: read_folder(scans[1], decode, every_class=False, by_bytes=stream)}
        if parts[False].classes != parts[True].classes:
            train_only = sorted(set(parts[True].classes) - set(parts[False].classes))
            test_only = sorted(set(parts[False].classes) - set(parts[True].classes))
            raise DataError(f"imagefolder {root}: train and {test_dir.name} have different class folders (only in train: "
                            f"{', '.join(train_only) or '-'}; only in {test_dir.name}: {', '.join(test_only) or '-'})")
        drop_copies_of(parts[False], parts[True], root)
    else:
        whole = read_folder(scans[0], decode, by_bytes=stream)  # copies are already gone, so none can land on both sides of the split
        order = torch.randperm(len(whole.labels), generator=torch.Generator().manual_seed(0)).tolist()
        n_test = max(1, len(order) // 10)
        parts = {is_train: FolderImages(whole.classes, *([getattr(whole, k)[i] for i in index] if getattr(whole, k) else []
                                                         for k in ("paths", "labels", "digests", "pictures")))  # pictures: none if streamed
                 for is_train, index in ((False, order[:n_test]), (True, order[n_test:]))}
        parts[True].notes = whole.notes
    classes, notes = parts[True].classes, [first_note] + parts[True].notes + parts[False].notes
    counts = {}  # images in each split, data.train_size / test_size applied
    for is_train, part in parts.items():
        n = len(part.labels) if (limit := train_size if is_train else test_size) is None else min(len(part.labels), limit)
        if n == 0:
            why = f" ({' / '.join(part.notes)})" if part.notes else ""
            raise DataError(f"imagefolder {root}: the {'training' if is_train else 'test'} split has no images{why}; add some")
        counts[is_train] = n
    if stream:
        return _streamed_folder(root, parts, counts, size, classes, notes)
    splits, natives = {}, {}
    for is_train, part in parts.items():
        n = counts[is_train]
        splits[is_train] = (torch.stack([p[0] for p in part.pictures[:n]]), torch.tensor(part.labels[:n], dtype=torch.long))
        natives[is_train] = [p[1] for p in part.pictures[:n]]
    mean = tuple((splits[True][0].float().mean((0, 2, 3)) / 255).tolist())
    std = tuple((splits[True][0].float().std((0, 2, 3)) / 255).clamp_min(1e-3).tolist())

    def pick(train: bool, index: Tensor, size: Tuple[int, int]) -> Tensor:
        return torch.cat([resize_images(natives[train][i][None], size) for i in index.tolist()])

    aspects = {t: torch.tensor([im.shape[-1] / im.shape[-2] for im in natives[t]]) for t in (True, False)}
    n_train = len(splits[True][1])
    fingerprint = digest_of(parts[True].digests[:n_train], parts[True].labels[:n_train])
    return ImageDataset(f"imagefolder:{root}", classes, 3, size, mean, std, True, False, lambda train, s: splits[train],
                        _pick=pick, _aspects=aspects, notes=tuple(notes), fingerprint=fingerprint)


def _streamed_folder(root: Path, parts: Dict[bool, FolderImages], counts: Dict[bool, int], size: Tuple[int, int],
                     classes: Tuple[str, ...], notes: List[str]) -> ImageDataset:
    """An image folder read a batch at a time: the first ``counts[split]`` files' paths and labels are all it holds."""
    from .stream import FolderSplit, decode_many, folder_aspects, sample_stats

    paths = {t: part.paths[: counts[t]] for t, part in parts.items()}
    labels = {t: torch.tensor(part.labels[: counts[t]], dtype=torch.long) for t, part in parts.items()}
    mean, std = sample_stats(paths[True])
    n_train = len(labels[True])
    fingerprint = "files:" + digest_of(parts[True].digests[:n_train], parts[True].labels[:n_train])  # by bytes, not pixels

    caches: Dict[bool, Any] = {}  # ImageDataset.keep_decoded fills it

    def pick(train: bool, index: Tensor, size: Tuple[int, int], boxes: Optional[Tensor] = None) -> Tensor:
        ids = index.tolist()
        return decode_many([paths[train][i] for i in ids], size, boxes, cache=caches.get(train), ids=ids)

    return ImageDataset(f"imagefolder:{root}", classes, 3, size, mean, std, True, False,
                        lambda train, s: (FolderSplit(paths[train], tuple(s)), labels[train]), _pick=pick, _pick_zoomed=pick,
                        notes=tuple(notes), fingerprint=fingerprint, streamed=True, _caches=caches,
                        _measure_aspects=lambda train: folder_aspects(paths[train]))


def _shards(root: Path, train_size: Optional[int], test_size: Optional[int], size: Tuple[int, int]) -> ImageDataset:
    """An image folder written as tar shards (:mod:`vitpe.data.shards`): read in order, a batch at a time."""
    from .shards import ShardSplit, read_index

    index = read_index(root)
    labels = {t: index.split_labels(t) for t in (True, False)}
    if train_size is not None and train_size < len(labels[True]):
        raise DataError(f"data.train_size={train_size} is fewer than the {len(labels[True])} pictures of shards:{root}, and an "
                        "epoch reads every shard; write shards of the pictures you want instead")
    if test_size is not None:
        labels[False] = labels[False][:test_size]
    note = (f"shards {root}: {len(labels[True]):,} training pictures in {len(index.files[True])} shards and {len(labels[False]):,} "
            "test pictures, read a batch at a time")

    def load(train: bool, s: Tuple[int, int]) -> Tuple[ShardSplit, Tensor]:
        return ShardSplit(list(index.files[train]), tuple(s), len(labels[train])), labels[train]

    def pick(train: bool, index: Tensor, size: Tuple[int, int], boxes: Optional[Tensor] = None) -> Tensor:
        raise DataError(f"shards:{root} is read in order, so it cannot give pictures by index (packing, train.max_tokens, "
                        "does); train on the image folder instead")

    return ImageDataset(f"shards:{root}", index.classes, 3, size, index.mean, index.std, True, False, load, _pick=pick, _pick_zoomed=pick,
                        notes=(note,), fingerprint=index.fingerprint, streamed=True, shards=index)


DATASETS = ("shapes", "gratings", "fashion_mnist", "cifar10", "cifar100", "imagefolder:PATH", "shards:PATH")


def load_dataset(
    name: str, data_dir: Optional[str] = None, train_size: Optional[int] = None, test_size: Optional[int] = None,
    image_size: Tuple[int, int] = (32, 32), stream: Optional[bool] = None, memory: Optional[int] = None,
) -> ImageDataset:
    """The dataset called ``name`` (see :data:`DATASETS`); ``data_dir`` defaults to ``./data``. ``stream`` (an image
    folder): read it a batch at a time (True), hold it in memory (False), or choose from its size and ``memory``, the
    bytes it may use (None; default: what the machine has available)."""
    root = Path(data_dir or "data")
    if name == "shapes":
        return _shapes(root, train_size, test_size)
    if name == "gratings":
        return _gratings(train_size, test_size)
    if name == "fashion_mnist":
        return _fashion_mnist(root, train_size, test_size)
    if name in ("cifar10", "cifar100"):
        return _cifar(name, root, train_size, test_size)
    if name.startswith("imagefolder:"):
        return _imagefolder(Path(name.split(":", 1)[1]).expanduser(), train_size, test_size, tuple(image_size), stream, memory)
    if name.startswith("shards:"):
        return _shards(Path(name.split(":", 1)[1]).expanduser(), train_size, test_size, tuple(image_size))
    raise DataError(f"unknown dataset {name!r}{did_you_mean(name, DATASETS)}; choose one of {', '.join(DATASETS)}")
