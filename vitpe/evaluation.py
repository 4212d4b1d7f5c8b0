"""The evaluation loop: a model on a test split at any size, by any route, and what a sweep of sizes sums to.

    from vitpe.evaluation import dataset_of, evaluate_at, sweep_summary
    ds = dataset_of(cfg)                                          # the data a run was trained on
    rows = list(evaluate_at(model, ds, [("interpolate", "coords", (64, 64))], device))

:func:`evaluate` scores one split at one size (top-1, top-5, loss, per-class top-1; test-time augmentation, FlexiViT's
patch route, resizing back); :func:`evaluate_native` every image at its own aspect ratio, packed; :func:`evaluate_at`
a plan of (coordinate mode, route, size), a row each, with the attention diagnostics; :func:`sweep_summary` the best
size and the mean top-1 over the log scale; :func:`write_results` a sweep's files and plots. The command over it is
``vitpe eval`` (:mod:`vitpe.cli.eval`); training scores its epochs with :func:`evaluate`. Without labels,
:func:`predict` gives the top classes of images (``vitpe predict``) of a model :func:`shipped_model` reads.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import model_from_checkpoint
from .config import Config, size_span, train_resolutions
from .coords import snap
from .data import load_dataset
from .data.augment import normalize, tta_views
from .data.datasets import shrink_to
from .engine import attention_bytes, autocast, memory_available, progress_steps
from .runs import write_csv, write_json
from .timm.pretrained import exported_run, is_exported
from .viz import attention_stats, plot_accuracy, plot_attention

__all__ = ["DEFAULT_SCALES", "DEFAULT_ASPECTS", "Scores", "evaluate", "evaluate_native", "evaluate_at", "sweep_summary",
           "default_resolutions", "data_args", "dataset_of", "patch_fits", "route_inputs", "trained_span", "write_rows", "write_results",
           "shipped_model", "predict", "route_logits"]

DEFAULT_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_ASPECTS = (0.5, 2.0)  # height / width of the default non-square sizes, at the training size's area


class Scores:
    """Running top-1, top-5, summed cross-entropy and (true, predicted) class counts over batches of logits: one
    scoring rule for every way of evaluating (fixed size, patch resize, packed native aspect ratio)."""

    def __init__(self) -> None:
        self.n, self.loss, self.top1, self.top5 = 0, 0.0, 0, 0
        self.pairs: Optional[Tensor] = None  # (classes, classes): per-class hits are its diagonal, images its row sums
        self.classes = 0

    def add(self, logits: Tensor, y: Tensor) -> None:
        logits = logits.float()
        self.loss += F.cross_entropy(logits, y, reduction="sum").item()
        self.classes = c = logits.shape[1]
        topk = logits.topk(min(5, c), dim=1).indices
        self.top1 += (topk[:, 0] == y).sum().item()
        self.top5 += (topk == y[:, None]).any(1).sum().item()
        pairs = torch.bincount(y * c + topk[:, 0], minlength=c * c).view(c, c).cpu()
        self.pairs = pairs if self.pairs is None else self.pairs + pairs
        self.n += len(y)

    def result(self, confusion: bool = False) -> Dict[str, float]:
        """The scores; ``confusion``: also the ``(classes, classes)`` counts of (true, predicted) class."""
        n = max(self.n, 1)
        out = {"top1": self.top1 / n, "loss": self.loss / n, "n": self.n}
        if self.classes > 5:
            out["top5"] = self.top5 / n
        out["per_class_top1"] = (self.pairs.diagonal() / self.pairs.sum(1).clamp_min(1)).tolist()
        if confusion:
            out["confusion"] = self.pairs.tolist()
        return out


@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 512,
    device: torch.device = torch.device("cpu"),
    dtype: Optional[torch.dtype] = None,
    progress: bool = False,  # a bar on a terminal, progress lines in a log
    desc: str = "eval",
    patch_size: Optional[int] = None,
    tta: str = "none",
    grid_of: Optional[Callable[[nn.Module, Tensor], Any]] = None,
    resize_to: Optional[Tuple[int, int]] = None,
    confusion: bool = False,
    stop: Optional[Callable[[int, int], bool]] = None,
) -> Dict[str, float]:
    """Top-1, top-5 (when there are more than 5 classes), mean cross-entropy and per-class top-1 over a split
    (``confusion``: also the (true, predicted) class counts, :meth:`Scores.result`).

    ``images`` are uint8, already at the size to evaluate; ``patch_size`` runs a vitpe ViT with a resized patch embedding (FlexiViT).
    ``tta``: average the predicted probabilities over test-time views (:data:`vitpe.data.augment.TTA_MODES`).
    ``grid_of(model, x)``: the coordinates a vitpe ViT gets for each normalized batch ``x`` (a
    :class:`~vitpe.coords.PatchGrid`; default: its own), for probes that move the positions and nothing else.
    ``resize_to=(h, w)``: each batch is resized to that size first (an exact area average when shrinking,
    :func:`vitpe.data.datasets.shrink_to`), as a user would resize an image to the size a model was trained at: the
    baseline of every resolution-transfer claim.
    ``stop(hits, n)``: asked after each batch with the top-1 hits so far; True ends the evaluation there (the scores
    are then of the first ``n`` images).
    """
    was_training = model.training
    model.eval()
    scores = Scores()
    kwargs = {} if patch_size is None else {"patch_size": patch_size}
    for s in progress_steps(len(labels), batch_size, desc, progress):
        batch = images[s : s + batch_size]
        x = normalize((batch if resize_to is None else shrink_to(batch, resize_to)).to(device, non_blocking=True), mean, std)
        probs = 0.0
        views = tta_views(x, tta)
        for view in views:
            if grid_of is not None:
                kwargs["grid"] = grid_of(model, view)
            with autocast(device, dtype):
                logits = model(view, **kwargs)
            probs = probs + logits.float().softmax(-1) / len(views)
        scores.add(logits if len(views) == 1 else probs.clamp_min(1e-12).log(), labels[s : s + batch_size].to(device))
        if stop is not None and stop(scores.top1, scores.n):
            break
    model.train(was_training)
    return scores.result(confusion)


@torch.no_grad()
def evaluate_native(
    model: nn.Module,
    ds,
    side: int,
    batch_size: int = 512,
    device: torch.device = torch.device("cpu"),
    dtype: Optional[torch.dtype] = None,
    progress: bool = False,
    desc: str = "eval native",
) -> Dict[str, float]:
    """:func:`evaluate` with every test image at its own aspect ratio (``ds.aspects``; square when the dataset has
    none) and the area of a ``side x side`` image, packed (a vitpe ViT; NaViT's evaluation). Also returns the mean
    patch tokens per image."""
    from .data.mixed import mixed_batch, native_sizes  # packing is loaded only for the native route

    labels = ds.split(False)[1]
    aspects = ds.aspects(False)
    p = model.patch_size
    sizes = native_sizes(aspects if aspects is not None else torch.ones(len(labels)), side, p)
    budget = max(max(h * w for h, w in sizes) // p**2, 4 * (side // p) ** 2)  # rows of several images, none too large
    was_training = model.training
    model.eval()
    scores = Scores()
    for s in progress_steps(len(labels), batch_size, desc, progress):
        index = torch.arange(s, min(s + batch_size, len(labels)))
        x = mixed_batch(ds, False, index, sizes[s : s + batch_size], p, budget).to(device)
        with autocast(device, dtype):
            logits = model(x)
        scores.add(logits, labels[index].to(device))
    model.train(was_training)
    return {**scores.result(), "tokens_per_image": sum(h * w for h, w in sizes) / p**2 / max(len(sizes), 1)}


def default_resolutions(img_size: int, patch: int) -> List[Tuple[int, int]]:
    """0.5x to 2x the training size (square), then the training area at aspect ratios 1:2 and 2:1."""
    sizes = sorted({snap(s * img_size, patch) for s in DEFAULT_SCALES})
    aspects = [(snap(img_size * a**0.5, patch), snap(img_size / a**0.5, patch)) for a in DEFAULT_ASPECTS]
    return [(s, s) for s in sizes] + [hw for hw in dict.fromkeys(aspects) if hw[0] != hw[1]]


def data_args(config: Config, name: Optional[str] = None, data_dir: Optional[str] = None, test_size: Optional[int] = None,
              image_size: Optional[Tuple[int, int]] = None) -> tuple:
    """``load_dataset``'s arguments for the data a run's ``config`` was trained on (or ``name``), with its test
    subset unless another is given, read as the run read it (a folder streamed or held): also the key under which one
    evaluation shares a loaded dataset."""
    own = config.data
    name = name or own.name
    test_size = test_size or (own.test_size if name == own.name else None)
    return name, data_dir or own.data_dir, None, test_size, image_size or (config.model.img_size,) * 2, own.stream if name == own.name else None


def dataset_of(config: Config, name: Optional[str] = None, data_dir: Optional[str] = None, test_size: Optional[int] = None,
               image_size: Optional[Tuple[int, int]] = None):
    """The dataset a run's ``config`` was trained on (see :func:`data_args`)."""
    return load_dataset(*data_args(config, name, data_dir, test_size, image_size))


def evaluate_at(model, ds, plan: Iterable[Tuple[str, str, Tuple[int, int]]], device: torch.device, dtype: Optional[torch.dtype] = None,
                batch_size: Union[int, Dict[Tuple[int, int], int]] = 256, desc: str = "", tta: str = "none",
                diagnostics: int = 0, stop: Optional[Callable[[int, int], bool]] = None) -> Iterator[Dict]:
    """``model`` on ``ds``'s test split for each ``(coord_mode, route, (h, w))`` of ``plan``: route ``"coords"`` meets
    the size with new coordinates on a new token grid, ``"patch"`` with FlexiViT's resized patch embedding on the
    trained grid, ``"resize"`` resizes each image back to the model's own size (the baseline a user has for free),
    ``"native"`` gives every image its own aspect ratio at the area of ``h x w``, packed. Yields one row
    per entry as it finishes: top-1, top-5, loss, per-class top-1, n, the patch tokens per image the model computed
    with, images/s of the evaluation itself and seconds in all (with loading and resizing). ``tta``: test-time
    augmentation (not for the native route, whose packed rows hold images of different sizes). ``diagnostics=N``: also
    each layer's attention distance (pixels) and entropy (nats, and over log(keys)), mean over heads, on the first N
    test images (:func:`vitpe.viz.attention_stats`; not for the native route). ``batch_size``: images per batch, or per
    size ``(h, w)`` (what :func:`memory_plan` allows). ``stop``: :func:`evaluate`'s, for every entry but the native
    route's."""
    for mode, route, (h, w) in plan:
        bs = batch_size[(h, w)] if isinstance(batch_size, dict) else batch_size
        model.coord_mode = mode
        t0 = time.time()
        extra: Dict = {}
        if route == "native":
            patch = None
            res = evaluate_native(model, ds, h, bs, device, dtype, progress=True, desc=f"{desc} @ native")
            seconds = time.time() - t0
            res["tokens_per_image"] = round(res["tokens_per_image"], 2)
        else:
            images, labels = ds.split_at(False, (h, w))  # a large size's split is made batch by batch
            patch, resize = route_inputs(model, route, (h, w))
            t1 = time.time()
            res = evaluate(model, images, labels, ds.mean, ds.std, bs, device, dtype, progress=True,
                           desc=f"{desc} @ {h}x{w}", patch_size=patch, tta=tta, resize_to=resize, stop=stop)
            seconds = time.time() - t1
            first = images[: max(diagnostics, 1)]
            sample = normalize((first if resize is None else shrink_to(first, resize)).to(device), ds.mean, ds.std)
            with torch.no_grad(), autocast(device, dtype):  # the tokens the model computes with (content_keep selects)
                tokens = model.embed(sample[:1], patch_size=patch)[0]
            res["tokens_per_image"] = tokens.shape[1] - model.num_prefix_tokens
            budget, scores = memory_available(device) // 2, attention_bytes(model, (h, w), patch)
            if diagnostics and scores > budget:  # the explicit scores of one image do not fit
                print(f"note: no attention diagnostics at {h}x{w}: one image's attention scores would take {scores / 2**30:.1f} GiB",
                      file=sys.stderr)
            elif diagnostics:
                with autocast(device, dtype):
                    stats = attention_stats(model, sample, patch_size=patch, max_bytes=budget)
                extra = {f"attn_{k}": [None if math.isnan(v) else round(v, 4) for v in t.nanmean(1).tolist()] for k, t in stats.items()}
        name = "native" if route == "native" else f"{h}x{w}" if h != w else str(h)
        yield {"coord_mode": mode, "route": route, "resolution": name, "height": h, "width": w,
               "patch_size": patch or model.patch_size, "tta": "none" if route == "native" else tta,
               **res, "images_per_s": round(res["n"] / max(seconds, 1e-9), 1), **extra, "seconds": round(time.time() - t0, 2)}


def sweep_summary(rows: List[Dict]) -> List[Dict]:
    """Per label (a run, mode and route): the best square size (the FixRes peak) and the area under top-1 against
    log2(scale) over the square sizes, divided by that log2 range: the mean top-1 over the sweep with every doubling
    weighted alike (one size: its top-1). Native rows and non-square sizes are left to the table."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        square = sorted((r for r in rows if r["label"] == label and r["route"] != "native" and r["height"] == r["width"]),
                        key=lambda r: r["height"])
        if not square:
            continue
        best = max(square, key=lambda r: r["top1"])
        own = [r["top1"] for r in square if r["height"] == r["train_size"]]
        x = [math.log2(r["height"] / r["train_size"]) for r in square]
        y = [r["top1"] for r in square]
        span = x[-1] - x[0]
        area = sum((x[i + 1] - x[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1))
        out.append({"label": label, "run": square[0]["run"], "data": square[0]["data"], "train_size": square[0]["train_size"],
                    "top1_at_train_size": own[0] if own else None, "best_resolution": best["resolution"], "best_top1": best["top1"],
                    "auc_log_scale": area / span if span > 0 else y[0], "from_resolution": square[0]["resolution"],
                    "to_resolution": square[-1]["resolution"]})
    return out


def trained_span(cfg: Config) -> Optional[str]:
    """``"LO-HI"``, the sizes a run trained at (``train.resolutions``, ``train.resolution_range`` or the stages of
    ``train.resolution_schedule``), or None when it trained at one: a result row's ``train_sizes``, shaded on the plots
    (when it trained at which: :func:`vitpe.config.schedule_text`, a row's ``train_schedule``)."""
    sizes = train_resolutions(cfg)
    return size_span(sizes) if len(sizes) > 1 else None


def route_inputs(model: nn.Module, route: str, size: Tuple[int, int]) -> Tuple[Optional[int], Optional[Tuple[int, int]]]:
    """``(patch_size, resize_to)`` of ``route`` at ``size``: the patch route's patch size (the trained token grid kept),
    the resize route's target (the model's own size); None where the route does not use it. Evaluation, the route
    planner (:mod:`vitpe.route_plan`), predict and export take a route through this one rule."""
    if route == "patch":
        if not patch_fits(model, *size):
            ref_h, ref_w = model.ref_grid
            raise ValueError(f"the patch route keeps the {ref_h}x{ref_w} token grid, so size {size[0]}x{size[1]} must be "
                             f"k*{ref_h} x k*{ref_w}")
        return size[0] // model.ref_grid[0], None
    if route == "resize":
        return None, tuple(model.img_size)
    return None, None


def patch_fits(model, h: int, w: int) -> bool:
    """Whether FlexiViT's patch route reaches ``h x w``: the trained token grid with a whole patch size."""
    ref_h, ref_w = model.ref_grid
    return h % ref_h == 0 and w % ref_w == 0 and h // ref_h == w // ref_w


def write_rows(rows: List[Dict], out: Path) -> None:
    """results.json and results.csv in ``out`` (made if needed), each written whole: after every size of a sweep, so
    that a kill loses at most the size it was on."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(rows, out / "results.json")
    write_csv(rows, out / "results.csv")  # per-class and per-layer lists stay in the JSON


def write_results(rows: List[Dict], out: Path, diagnostics: int) -> List[Dict]:
    """results.json/.csv, summary.json/.csv and the plots in ``out``; returns the summary."""
    summary = sweep_summary(rows)
    write_rows(rows, out)
    write_json(summary, out / "summary.json")
    write_csv(summary, out / "summary.csv")
    data = ", ".join(sorted({r["data"] for r in rows}))
    plot_accuracy(rows, out / "accuracy_vs_resolution.png", f"top-1 against resolution ({data})")
    if any(r.get("attn_distance") for r in rows):
        plot_attention(rows, out / "attention_vs_resolution.png", f"attention against resolution ({data}, {diagnostics} test images)")
    return summary


def shipped_model(path: str, ema: bool = True) -> Tuple[torch.nn.Module, Dict]:
    """The model at ``path`` (a run, its checkpoint, or a folder :func:`vitpe.save_pretrained` or ``python -m
    vitpe.export --hf`` wrote) and how its images are read: ``in_chans``, ``mean``, ``std``, ``classes`` (an exported
    folder without names: the head's row numbers)."""
    model, state = exported_run(path) if is_exported(path) else model_from_checkpoint(path, ema=ema)
    return model, state["data"]


@torch.no_grad()
def predict(model: torch.nn.Module, images: Tensor, mean: Sequence[float], std: Sequence[float], top: int = 3,
            batch_size: int = 64, route: str = "coords") -> Tuple[Tensor, Tensor]:
    """Top-``top`` probabilities and class indices ``(N, top)`` of uint8 ``images``, ``batch_size`` images at a time,
    taken to the model by ``route`` (:func:`route_logits`)."""
    probs = torch.cat([route_logits(model, x, mean, std, route).float().softmax(-1) for x in images.split(batch_size)])
    return probs.topk(min(top, probs.shape[-1]), dim=-1)


@torch.no_grad()
def route_logits(model: torch.nn.Module, images: Tensor, mean: Sequence[float], std: Sequence[float], route: str = "coords") -> Tensor:
    """The logits of uint8 ``images`` at their size taken to ``model`` by ``route`` (:func:`route_inputs`): what
    :func:`evaluate` computes for a batch, in the model's coordinate mode as it is set."""
    model.eval()
    patch, resize = route_inputs(model, route, tuple(images.shape[-2:]))
    x = normalize(images if resize is None else shrink_to(images, resize), mean, std)
    return model(x) if patch is None else model(x, patch_size=patch)
