"""Image files read the way a viewer shows them, and class-per-folder image sets read so that no file is counted twice.

``open_image(path)``: one file as upright 8-bit RGB (EXIF orientation applied, 16-bit scaled, too-large images refused
in one line). ``read_folder(root)``: every image under ``root/CLASS/...`` once: hidden files and folders, files that
are not images and folders reached a second time through a link are skipped, and images with the same pixels under
two names are kept once (in none when they sit in two classes). What was skipped and why comes back as notes, one
line each, for the command line to print.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..errors import VitpeError

__all__ = ["DataError", "IMAGE_EXTENSIONS", "open_image", "turned", "FolderImages", "FolderScan", "scan_folder", "file_digests", "read_folder",
           "drop_copies_of", "digest_of", "read_images"]

# What PIL decodes and users keep images in; a GIF gives its first frame.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".pbm", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_SYSTEM_FOLDERS = ("__MACOSX", "@eaDir", "$RECYCLE.BIN", "System Volume Information")  # archivers' and NAS' own
_EXAMPLES = 3  # paths named per note


class DataError(VitpeError, RuntimeError):
    """A dataset that is missing, corrupt or unknown; the message says how to fix it."""


# Formats whose only integer pixels wider than 8 bits are 16-bit, which PIL may open as its 32-bit mode "I" (a 16-bit PGM)
_SIXTEEN_BIT_ONLY = ("PNG", "PPM")


def _to_rgb(im, path: str, file_format: Optional[str] = None):
    """An opened PIL image as 8-bit RGB. 16-bit images (``I;16``, or PIL's ``I`` from a format that has no wider
    integers: a 16-bit PGM) are scaled to 8 bits, not clipped; float or 32-bit pixels (a 32-bit TIFF, whatever values it
    holds: 0..255 there once became black) have no known range and are refused, naming the file; transparent pixels show
    white. ``file_format``: PIL's name of the file's format (``im.format`` before any transform)."""
    import numpy as np
    from PIL import Image

    if im.mode.startswith("I"):
        arr = np.asarray(im).astype(np.int64)
        sixteen = im.mode.startswith("I;16") or (file_format or im.format) in _SIXTEEN_BIT_ONLY
        if not sixteen or (arr.size and (arr.min() < 0 or arr.max() > 65535)):
            span = f" ({arr.min()}..{arr.max()})" if arr.size else ""
            raise DataError(f"image {path} has 32-bit integer pixels{span} with no known range; convert it to 8 or 16 bits")
        im = Image.fromarray(np.round(arr / 257).astype(np.uint8), mode="L")
    elif im.mode == "F":
        raise DataError(f"image {path} has floating-point pixels (mode F) with no known range; convert it to 8 or 16 bits")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode in ("P", "L", "RGB") and "transparency" in im.info):
        # Transparent pixels keep whatever colour the file stored under them (often black, or leftovers); a viewer shows
        # the background through them: composite over white, as a page shows it.
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im.convert("RGB")


def turned(im) -> bool:
    """Whether an opened picture's EXIF orientation (5-8) swaps its stored width and height when it stands upright."""
    return im.getexif().get(0x0112, 1) in (5, 6, 7, 8)


def readable(source: Union[str, Path, bytes]):
    """What PIL opens for ``source``: a path as it is, a file's bytes (a sample of a tar shard) as a file object."""
    return io.BytesIO(source) if isinstance(source, bytes) else source


def open_image(path, at_least: Optional[Tuple[float, float]] = None, name: Optional[str] = None) -> "PIL.Image.Image":  # noqa: F821 (PIL is imported where it is used)
    """The file at ``path`` (or its bytes, called ``name`` in errors) as the 8-bit RGB picture a viewer shows: EXIF
    orientation applied (a phone photo taken sideways stands up), 16-bit pixels scaled. ``at_least = (width,
    height)``: the upright picture may come smaller, down to that size (a JPEG decodes at 1/2, 1/4 or 1/8 scale for a
    fraction of the work; other formats ignore it). One-line :class:`DataError` for a missing, unreadable or too-large
    file."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    name = str(path) if name is None else name
    try:
        with Image.open(readable(path)) as im:
            if at_least is not None and im.format == "JPEG":
                w, h = at_least[::-1] if turned(im) else at_least
                im.draft(None, (math.ceil(w), math.ceil(h)))
            return _to_rgb(ImageOps.exif_transpose(im), name, im.format)
    except FileNotFoundError:
        raise DataError(f"image {name} does not exist") from None
    except Image.DecompressionBombError as e:
        raise DataError(f"image {name} is too large to decode safely ({e}); shrink it, or raise PIL.Image.MAX_IMAGE_PIXELS") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # SyntaxError, ValueError: PIL's words for bad headers
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot read image {name} ({type(e).__name__}: {str(e)[:80]}); give PNG, JPEG or another format PIL "
                        "opens, or remove or replace it") from None


@dataclass
class FolderImages:
    """The images of a class-per-folder set, each once: ``paths``, ``labels`` (indices into ``classes``) and
    ``digests`` (SHA-256 of each picture's pixels, upright, at its own size) in the same order; ``pictures`` the decoded
    images; ``notes``: what was skipped and why, one line each."""

    classes: Tuple[str, ...]
    paths: List[str] = field(default_factory=list)
    labels: List[int] = field(default_factory=list)
    digests: List[str] = field(default_factory=list)
    pictures: List = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _pixel_digest(im) -> str:
    return hashlib.sha256(f"{im.mode}{im.size}".encode() + im.tobytes()).hexdigest()


def _examples(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_EXAMPLES])
    return shown + (f" and {len(items) - _EXAMPLES} more" if len(items) > _EXAMPLES else "")


def _hidden(name: str) -> bool:
    return name.startswith(".") or name in _SYSTEM_FOLDERS  # .git, .DS_Store, AppleDouble ._x.png


def _class_files(class_dir: Path, root: Path, seen_dirs: Dict[str, str], skipped: Dict[str, List[str]]) -> List[str]:
    """The image files under ``class_dir``, links followed, each folder read once (a link loop or a second link to a
    folder already read is skipped and noted)."""
    files = []
    for top, dirs, names in os.walk(class_dir, followlinks=True):
        keep = []
        for d in sorted(dirs):
            rel = os.path.relpath(os.path.join(top, d), root)
            if _hidden(d):
                skipped["hidden"].append(rel + "/")
                continue
            real = os.path.realpath(os.path.join(top, d))
            if real in seen_dirs:
                skipped["loop"].append(f"{rel} -> {seen_dirs[real]}")
                continue
            seen_dirs[real] = rel
            keep.append(d)
        dirs[:] = keep
        for name in sorted(names):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root)
            if _hidden(name):
                skipped["hidden"].append(rel)
            elif not name.lower().endswith(IMAGE_EXTENSIONS):
                skipped["not_image"].append(rel)
            elif not os.path.exists(path):
                skipped["broken"].append(rel)
            else:
                files.append(path)
    return files


@dataclass
class FolderScan:
    """What :func:`scan_folder` found: the class folders, each image file with its class, and what was skipped."""

    root: Path
    classes: Tuple[str, ...]
    paths: List[str]
    labels: List[int]
    skipped: Dict[str, List[str]]


def scan_folder(root: Path) -> FolderScan:
    """The image files under ``root/CLASS/`` (links followed, each folder read once), with their classes; nothing is
    opened. Raises :class:`DataError` for fewer than two class folders or a class folder that links to another."""
    root = Path(root)
    skipped: Dict[str, List[str]] = defaultdict(list)
    classes = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if _hidden(entry.name):
            skipped["hidden"].append(entry.name + ("/" if entry.is_dir() else ""))
        elif entry.is_dir():
            classes.append(entry.name)
        else:
            skipped["loose"].append(entry.name)
    if not classes:
        raise DataError(f"imagefolder {root} has no class folders: put each class's images in a sub-folder named after it "
                        f"(e.g. {root}/cat/1.png, {root}/dog/1.png)")
    if len(classes) < 2:
        raise DataError(f"imagefolder {root} has 1 class folder ({classes[0]}); a classifier needs at least 2 classes: "
                        "add a folder per class")
    seen_dirs = {os.path.realpath(root): "."}
    paths, labels = [], []
    for label, name in enumerate(classes):
        real = os.path.realpath(root / name)
        if real in seen_dirs:
            raise DataError(f"imagefolder {root}: class folder {name} is a link to {seen_dirs[real]}, read already: one picture "
                            "cannot be two classes; remove the link, or give the class its own images")
        seen_dirs[real] = name
        for path in _class_files(root / name, root, seen_dirs, skipped):
            paths.append(path)
            labels.append(label)
    return FolderScan(root, tuple(classes), paths, labels, skipped)


_HEAD_BYTES = 4096


def _head_key(path: str) -> str:
    with open(path, "rb") as f:
        return f"{os.fstat(f.fileno()).st_size}:{hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()}"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(paths: Sequence[str]) -> List[str]:
    """A digest per file, equal exactly when two files hold the same bytes: the size and the first 4 KiB, and where
    files share those, the SHA-256 of all their bytes. A folder of any size is told apart from 4 KiB a file (photos
    differ in their first bytes), so listing 20,000 photos reads 80 MB, not their gigabytes; a copy is always caught."""
    # One thread: 4 KiB reads are too short for a pool to pay (20,000 files: 0.3 s alone, 1.5 s on 8 threads).
    heads = [_head_key(p) for p in paths]
    counts: Dict[str, int] = defaultdict(int)
    for k in heads:
        counts[k] += 1
    for i, k in enumerate(heads):
        if counts[k] > 1:
            heads[i] = f"sha256:{_file_sha256(paths[i])}"
    return heads


def read_folder(root: Union[Path, FolderScan], decode=None, every_class: bool = True, by_bytes: bool = False) -> FolderImages:
    """Every image under ``root/CLASS/`` once, with its class (``root``: a folder, or its :func:`scan_folder` already
    made). ``decode(picture)`` turns each upright RGB PIL picture into what is kept (default: the picture itself).
    ``by_bytes``: open nothing and keep no pictures; copies are files with the same bytes (:func:`file_digests`), for
    data read a batch at a time. Raises :class:`DataError` for fewer than two class folders, or (with ``every_class``,
    as for training) a class folder without images."""
    scan = root if isinstance(root, FolderScan) else scan_folder(root)
    root, classes, paths, labels, skipped = scan.root, scan.classes, scan.paths, scan.labels, scan.skipped
    out = FolderImages(classes)
    pictures: List = []
    if by_bytes:
        digests = file_digests(paths)
    else:
        digests = []
        for path in paths:
            im = open_image(path)
            digests.append(_pixel_digest(im))
            pictures.append(decode(im) if decode is not None else im)
    by_digest: Dict[str, List[int]] = defaultdict(list)  # digest -> indices into the lists above
    for i, digest in enumerate(digests):
        by_digest[digest].append(i)
    same = "bytes" if by_bytes else "pixels"
    drop = set()
    copies, ambiguous = [], []
    for index in by_digest.values():
        if len(index) == 1:
            continue
        names = [os.path.relpath(paths[i], root) for i in index]
        if len({labels[i] for i in index}) > 1:  # the same picture under two labels: either would be wrong half the time
            drop.update(index)
            ambiguous.append(" = ".join(names))
        else:
            drop.update(index[1:])
            copies.append(" = ".join(names))
    for i in range(len(paths)):
        if i not in drop:
            out.paths.append(paths[i])
            out.labels.append(labels[i])
            out.digests.append(digests[i])
            if pictures:
                out.pictures.append(pictures[i])
    empty = [c for i, c in enumerate(classes) if i not in set(out.labels)]
    if empty and every_class:
        raise DataError(f"imagefolder {root}: class folder {empty[0]} has no images vitpe reads ({', '.join(IMAGE_EXTENSIONS)}); "
                        "add images, or remove the folder")
    where = f"imagefolder {root}"
    if skipped["hidden"]:
        out.notes.append(f"{where}: skipped {len(skipped['hidden'])} hidden files and folders ({_examples(skipped['hidden'])})")
    if skipped["not_image"]:
        out.notes.append(f"{where}: skipped {len(skipped['not_image'])} files that are not images by their name "
                         f"({_examples(skipped['not_image'])}); vitpe reads {', '.join(IMAGE_EXTENSIONS)}")
    if skipped["loose"]:
        out.notes.append(f"{where}: skipped {len(skipped['loose'])} files outside the class folders ({_examples(skipped['loose'])})")
    if skipped["broken"]:
        out.notes.append(f"{where}: skipped {len(skipped['broken'])} links that lead nowhere ({_examples(skipped['broken'])})")
    if skipped["loop"]:
        out.notes.append(f"{where}: skipped {len(skipped['loop'])} links to folders already read, so that no image counts twice "
                         f"({_examples(skipped['loop'])})")
    if copies:
        out.notes.append(f"{where}: {len(copies)} images appear more than once in one class (the same {same}: "
                         f"{_examples(copies)}); each is kept once, so no copy lands on both sides of the train/test split")
    if ambiguous:
        out.notes.append(f"{where}: left out {len(ambiguous)} images found in more than one class (the same {same}: "
                         f"{_examples(ambiguous)}); their label is ambiguous")
    return out


def drop_copies_of(test: FolderImages, train: FolderImages, root: Path) -> None:
    """Remove from ``test`` every image whose pixels are those of a training image (a test score on a copy of a
    training image measures memory, not accuracy), with a note."""
    seen = set(train.digests)
    keep = [i for i, d in enumerate(test.digests) if d not in seen]
    if len(keep) == len(test.digests):
        return
    gone = [os.path.relpath(test.paths[i], root) for i in range(len(test.digests)) if test.digests[i] in seen]
    for name in ("paths", "labels", "digests", "pictures"):
        values = getattr(test, name)
        setattr(test, name, [values[i] for i in keep] if values else values)  # pictures: none kept when read by bytes
    test.notes.append(f"imagefolder {root}: left out {len(gone)} test images that are copies of training images "
                      f"({_examples(gone)}), so that the test score measures images the model has not seen")


def digest_of(digests: Sequence[str], labels: Sequence[int]) -> str:
    """One fingerprint of a split: which pictures, with which labels (order-free)."""
    h = hashlib.sha256()
    for d, y in sorted(zip(digests, labels)):
        h.update(f"{d}:{y};".encode())
    return h.hexdigest()[:16]


def read_images(paths: Sequence[str], in_chans: int, size: Tuple[int, int]) -> Tensor:
    """uint8 ``(N, in_chans, h, w)`` of image files, read as a run's data was: each decoded upright (:func:`open_image`:
    EXIF orientation applied), converted (RGB or grayscale) and resized bicubically to ``size``."""
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    out = []
    for path in paths:
        rgb = open_image(path)
        im = rgb if in_chans == 3 else rgb.convert("L")
        out.append(pil_to_tensor(im.resize(size[::-1], Image.BICUBIC)))
    return torch.stack(out)
