"""Evaluate trained checkpoints at several resolutions: tables, JSON, CSV and plots.

    python eval.py runs/RUN                                            # 0.5x .. 2x the training size, 1:2 and 2:1
    python eval.py runs/A runs/B --resolutions 16 32 48 64 128         # compare runs on one table and plot
    python eval.py runs/A --resolutions 32x48 --coord-mode both       # non-square; both coordinate modes
    python eval.py runs/A --resolutions 32 64 128 --route both         # new grid, or FlexiViT's resized patches
    python eval.py runs/A --native                                     # also every image at its own aspect ratio
    python eval.py runs/A --coord-mode extrapolate --rope-scaling yarn # RoPE extrapolation: pi, ntk or yarn

The model is rebuilt from the checkpoint alone. ``shapes`` is rendered natively at each resolution;
other data is resized (antialiased). Results go to RUN/eval-TIMESTAMP/ (or --out): results.json and
results.csv (a row per size: top-1, tokens, images/s, each layer's attention distance and entropy),
summary.json and summary.csv (per run and mode: the best size and the mean top-1 over the log scale),
accuracy_vs_resolution.png and attention_vs_resolution.png.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from vitpe.checkpoint import check_classes, checkpoint_config, find_checkpoint, model_from_checkpoint
from vitpe.config import Config, ConfigError, train_resolutions
from vitpe.coords import COORD_MODES, snap
from vitpe.data import load_dataset
from vitpe.data.augment import TTA_MODES, normalize
from vitpe.data.datasets import shrink_to
from vitpe.engine import amp_dtype, attention_bytes, autocast, evaluate, evaluate_native, memory_available, memory_plan, resolve_device
from vitpe.errors import run_cli
from vitpe.pos_embed import PEOption, pe_test_options, set_pe_option
from vitpe.pretrained import exported_run, is_exported
from vitpe.runs import write_csv, write_json
from vitpe.suggest import did_you_mean

DEFAULT_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_ASPECTS = (0.5, 2.0)  # height / width of the default non-square sizes, at the training size's area
DIAGNOSTIC_IMAGES = 64


def parse_resolution(text: str) -> Tuple[int, int]:
    h, _, w = text.lower().partition("x")
    try:
        size = (int(h), int(w or h))
    except ValueError:
        raise argparse.ArgumentTypeError(f"resolution {text!r} must be N or HxW, e.g. 64 or 32x48") from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"resolution {text!r} must be positive")
    return size


def whole_number(text: str, minimum: int = 1) -> int:
    """An argparse type: a whole number of at least ``minimum``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def count(text: str) -> int:
    return whole_number(text, 0)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="RUN_OR_EXPORT",
                   help="runs (runs/NAME), their checkpoint.pt, or folders python -m vitpe.export --hf wrote")
    p.add_argument("--resolutions", nargs="+", type=parse_resolution, metavar="N|HxW",
                   help="input sizes (default: 0.5, 0.75, 1, 1.5, 2 x each run's training size, rounded to its patch size)")
    p.add_argument("--data", help="dataset to evaluate on (default: each run's own)")
    p.add_argument("--data-dir", help="dataset directory (default: each run's own, else ./data)")
    p.add_argument("--test-size", type=positive_int, help="evaluate on the first N test images")
    p.add_argument("--coord-mode", choices=["checkpoint", *COORD_MODES, "both", "all"], default="checkpoint",
                   help="patch coordinates at new resolutions (default: what each run was trained with; extend: "
                        "extrapolate the axes longer than trained, interpolate the others; both: interpolate and "
                        "extrapolate; all: every mode)")
    p.add_argument("--pe-option", dest="pe_options", action="append", default=[], metavar="[FAMILY.]OPTION=VALUE",
                   help="set a test-time option a family declares (default: as trained), e.g. " + ", ".join(
                       f"{key}" for key in list(pe_test_options())[:3]) + "; every one: vitpe.pe_test_options(); repeatable")
    for flag, key, option in option_flags():
        p.add_argument(flag, dest="pe_options", action=_PEOptionFlag, const=key, type=_option_type(option),
                       metavar=option.name.upper(), help=f"the same as --pe-option {key}=VALUE: {option.help}")
    p.add_argument("--route", choices=["coords", "patch", "resize", "both", "all"], default="coords",
                   help="meet a new resolution with new coordinates on a new token grid (coords), by resizing the patch "
                        "embedding to keep the trained grid (patch: FlexiViT's PI-resize), or by resizing the image back to "
                        "the model's own size (resize: the baseline); both: coords and patch; all: the three")
    p.add_argument("--native", action="store_true",
                   help="also evaluate every test image at its own aspect ratio with the training size's area, packed "
                        "(NaViT; an image folder keeps each file's aspect ratio, other datasets are square)")
    p.add_argument("--tta", choices=TTA_MODES, default="none",
                   help="test-time augmentation: average the predictions over the mirror image (flip), 1-pixel shifts (shift) or both")
    p.add_argument("--diagnostics", type=count, default=DIAGNOSTIC_IMAGES, metavar="N",
                   help=f"attention distance and entropy per layer at each size, on the first N test images (default "
                        f"{DIAGNOSTIC_IMAGES}; 0: off)")
    p.add_argument("--batch-size", type=positive_int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-ema", action="store_true", help="use the raw weights even if the run kept an EMA")
    p.add_argument("--no-verify", action="store_true", help="load checkpoints whose checksum does not match")
    p.add_argument("--out", help="output directory (default: FIRST_RUN/eval-TIMESTAMP)")
    return p.parse_args(argv)


def option_flags() -> List[Tuple[str, str, PEOption]]:
    """(flag, option key, option) of every flag the families declare for a test-time option (a bias family's slope,
    ``--rope-scaling``). A flag that several families declare for one option (every rotary family's ``--rope-scaling``)
    sets it on each part of a model that takes it: its key is the option's bare name."""
    owners: Dict[str, List[Tuple[str, PEOption]]] = {}
    for key, option in pe_test_options().items():
        if option.flag:
            owners.setdefault(option.flag, []).append((key, option))
    out = []
    for flag, declared in owners.items():
        names = {option.name for _, option in declared}
        if len(names) > 1:  # a family's mistake, caught by the suite's first parse
            raise TypeError(f"the flag {flag} is declared for different options ({', '.join(sorted(names))}): give each its own flag")
        out.append((flag, declared[0][0] if len(declared) == 1 else names.pop(), declared[0][1]))
    return out


class _PEOptionFlag(argparse.Action):
    """A family's own flag (``--FLAG VALUE``): the same as ``--pe-option FAMILY.OPTION=VALUE``."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        namespace.pe_options = [*namespace.pe_options, f"{self.const}={value}"]


def _option_type(option):
    """An argparse type that checks a value as its option parses it."""
    def parse(text: str):
        try:
            option.parse(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {option.name}: {e}") from None
        return text

    return parse


def parse_pe_options(items: List[str]) -> List[Tuple[str, str]]:
    """``--pe-option`` items as ``(key, text)``; a malformed item, or one that names a family's option that does not
    exist, is refused here, before any model is loaded (an option without a family is checked against each model)."""
    known, out = pe_test_options(), []
    for item in items:
        key, eq, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not key or not text:
            raise ConfigError(f"--pe-option {item!r} must look like FAMILY.OPTION=VALUE, e.g. {next(iter(known), 'family.option')}=1")
        if "." in key and key not in known:
            raise ConfigError(f"--pe-option {key!r}: no registered family declares it{did_you_mean(key, list(known))}; "
                              f"the options: {', '.join(known)}")
        if key in known:
            try:
                _option_type(known[key])(text)
            except argparse.ArgumentTypeError as e:
                raise ConfigError(f"--pe-option {key}: {e}") from None
        out.append((key, text))
    return out


def option_value(options: List[Tuple[str, str]], name: str) -> Optional[str]:
    """The value :func:`parse_pe_options`' ``options`` give test-time option ``name`` (bare or as ``FAMILY.name``; the
    last one given)."""
    given = [text for key, text in options if key.rpartition(".")[2] == name]
    return given[-1] if given else None


def default_resolutions(img_size: int, patch: int) -> List[Tuple[int, int]]:
    """0.5x to 2x the training size (square), then the training area at aspect ratios 1:2 and 2:1."""
    sizes = sorted({snap(s * img_size, patch) for s in DEFAULT_SCALES})
    aspects = [(snap(img_size * a**0.5, patch), snap(img_size / a**0.5, patch)) for a in DEFAULT_ASPECTS]
    return [(s, s) for s in sizes] + [hw for hw in dict.fromkeys(aspects) if hw[0] != hw[1]]


def data_args(config: Config, name: Optional[str] = None, data_dir: Optional[str] = None, test_size: Optional[int] = None,
              image_size: Optional[Tuple[int, int]] = None) -> tuple:
    """``load_dataset``'s arguments for the data a run's ``config`` was trained on (or ``name``), with its test
    subset unless another is given: also the key under which one evaluation shares a loaded dataset."""
    own = config.data
    name = name or own.name
    test_size = test_size or (own.test_size if name == own.name else None)
    return name, data_dir or own.data_dir, None, test_size, image_size or (config.model.img_size,) * 2


def dataset_of(config: Config, name: Optional[str] = None, data_dir: Optional[str] = None, test_size: Optional[int] = None,
               image_size: Optional[Tuple[int, int]] = None):
    """The dataset a run's ``config`` was trained on (see :func:`data_args`)."""
    return load_dataset(*data_args(config, name, data_dir, test_size, image_size))


def evaluate_at(model, ds, plan: Iterable[Tuple[str, str, Tuple[int, int]]], device: torch.device, dtype: Optional[torch.dtype] = None,
                batch_size: Union[int, Dict[Tuple[int, int], int]] = 256, desc: str = "", tta: str = "none",
                diagnostics: int = 0) -> Iterator[Dict]:
    """``model`` on ``ds``'s test split for each ``(coord_mode, route, (h, w))`` of ``plan``: route ``"coords"`` meets
    the size with new coordinates on a new token grid, ``"patch"`` with FlexiViT's resized patch embedding on the
    trained grid, ``"resize"`` resizes each image back to the model's own size (the baseline a user has for free),
    ``"native"`` gives every image its own aspect ratio at the area of ``h x w``, packed. Yields one row
    per entry as it finishes: top-1, top-5, loss, per-class top-1, n, the patch tokens per image the model computed
    with, images/s of the evaluation itself and seconds in all (with loading and resizing). ``tta``: test-time
    augmentation (not for the native route, whose packed rows hold images of different sizes). ``diagnostics=N``: also
    each layer's attention distance (pixels) and entropy (nats, and over log(keys)), mean over heads, on the first N
    test images (:func:`vitpe.viz.attention_stats`; not for the native route). ``batch_size``: images per batch, or per
    size ``(h, w)`` (what :func:`memory_plan` allows)."""
    ref_h = model.ref_grid[0]
    for mode, route, (h, w) in plan:
        bs = batch_size[(h, w)] if isinstance(batch_size, dict) else batch_size
        model.coord_mode = mode
        t0 = time.time()
        extra: Dict = {}
        if route == "native":
            res = evaluate_native(model, ds, h, bs, device, dtype, progress=True, desc=f"{desc} @ native")
            seconds = time.time() - t0
            res["tokens_per_image"] = round(res["tokens_per_image"], 2)
        else:
            images, labels = ds.split_at(False, (h, w))  # a large size's split is made batch by batch
            patch = h // ref_h if route == "patch" else None
            resize = model.img_size if route == "resize" else None
            t1 = time.time()
            res = evaluate(model, images, labels, ds.mean, ds.std, bs, device, dtype, progress=True,
                           desc=f"{desc} @ {h}x{w}", patch_size=patch, tta=tta, resize_to=resize)
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
                from vitpe.viz import attention_stats

                with autocast(device, dtype):
                    stats = attention_stats(model, sample, patch_size=patch, max_bytes=budget)
                extra = {f"attn_{k}": [None if math.isnan(v) else round(v, 4) for v in t.nanmean(1).tolist()] for k, t in stats.items()}
        name = "native" if route == "native" else f"{h}x{w}" if h != w else str(h)
        yield {"coord_mode": mode, "route": route, "resolution": name, "height": h, "width": w,
               "patch_size": h // ref_h if route == "patch" else model.patch_size, "tta": "none" if route == "native" else tta,
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
    """``"LO-HI"``, the sizes a run trained at (``train.resolutions`` or ``train.resolution_range``), or None when it
    trained at one: a result row's ``train_sizes``, shaded on the plots."""
    sizes = train_resolutions(cfg)
    return f"{min(sizes)}-{max(sizes)}" if len(sizes) > 1 else None


def _resolution_axis(ax, rows: List[Dict]) -> None:
    """The x axis of every sweep plot: resolution on a log scale, ticks at the evaluated sizes, the training sizes dotted."""
    ax.set_xscale("log", base=2)
    square = [r for r in rows if r["height"] == r["width"]] or rows  # non-square sizes are marked, not ticked (they crowd 1x)
    ticks = sorted({(r["height"] * r["width"]) ** 0.5 for r in square})
    ax.set_xticks(ticks, [next(r["resolution"] for r in square if (r["height"] * r["width"]) ** 0.5 == t) for t in ticks])
    ax.minorticks_off()
    lo, hi = min(ticks), max(ticks)
    for s in sorted({r["train_size"] for r in rows}):  # labelled, and inside the axes even when not evaluated there
        ax.axvline(s, color="grey", lw=0.8, ls=":")
        ax.annotate(f"trained at {s}", (s, 1), xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                    fontsize=7, color="grey", va="top", rotation=90)
        lo, hi = min(lo, s), max(hi, s)
    for span in sorted({r.get("train_sizes") for r in rows} - {None}):  # a run trained at several sizes: the range, shaded
        a, b = (int(v) for v in span.split("-"))
        ax.axvspan(a, b, color="grey", alpha=0.12, lw=0)
        ax.annotate(f"trained at {span}", (a, 1), xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                    fontsize=7, color="grey", va="top")
        lo, hi = min(lo, a), max(hi, b)
    ax.set_xlim(lo / 1.15, hi * 1.15)


def _xlabel(rows: List[Dict], *more: str) -> str:
    """The sweep plots' x label, naming the marks drawn on the axis."""
    marks = ["dotted: training resolution", *(["shaded: sizes trained at"] if any(r.get("train_sizes") for r in rows) else []), *more]
    return f"input resolution ({'; '.join(marks)})"


def _lines(ax, rows: List[Dict], value) -> None:
    """``value(row)`` against resolution, a line per label (square and non-square sizes by their area), at most
    ``MAX_LINES`` of them: further labels become one grey band (``draw_series``)."""
    from vitpe.viz.plots import draw_series

    labels = list(dict.fromkeys(r["label"] for r in rows))
    series = {label: [((r["height"] * r["width"]) ** 0.5, value(r)) for r in rows if r["label"] == label and r["height"] == r["width"]]
              for label in labels}
    colours = draw_series(ax, series)
    for label, colour in colours.items():
        odd = [r for r in rows if r["label"] == label and r["height"] != r["width"]]
        for k, r in enumerate(odd):  # another aspect ratio: a labelled marker at its area
            x = (r["height"] * r["width"]) ** 0.5
            ax.plot([x], [value(r)], marker="s", mfc="none", color=colour)
            ax.annotate(r["resolution"], (x, value(r)), xytext=(5, 6 - 12 * (k % 2)), textcoords="offset points", fontsize=7,
                        color=colour, va="center")


def plot(rows: List[Dict], path: Path, title: str) -> None:
    from vitpe.viz import finish_plot, pyplot

    rows = [r for r in rows if r["route"] != "native"]  # no one size: the table reports it
    fig, ax = pyplot().subplots(figsize=(7, 4.5), dpi=120)
    _lines(ax, rows, lambda r: 100 * r["top1"])
    _resolution_axis(ax, rows)
    for chance in sorted({r["chance"] for r in rows if r.get("chance")}):  # rows of older results have none
        ax.axhline(100 * chance, color="grey", lw=0.8, ls="--")
        ax.annotate(f"chance {100 * chance:.3g}%", (0, 100 * chance), xycoords=("axes fraction", "data"), xytext=(3, 2),
                    textcoords="offset points", fontsize=7, color="grey")
    ax.set_xlabel(_xlabel(rows, "dashed: chance"))
    ax.set_ylabel("top-1 accuracy (%)")
    finish_plot(fig, ax, title, path)


def plot_attention(rows: List[Dict], path: Path, title: str) -> None:
    """Attention against resolution, mean over layers: distance in patches (the model's coordinate unit: constant
    where a model attends as it did at its training size) and entropy over log(keys) (1: uniform; a fall far from
    the training size is the entropy collapse the extrapolation studies report)."""
    from vitpe.viz import pyplot
    from vitpe.viz.plots import wrapped

    rows = [r for r in rows if r.get("attn_distance")]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4.5), dpi=120)
    mean = lambda xs: sum(x for x in xs if x is not None) / max(1, sum(x is not None for x in xs))  # noqa: E731
    _lines(left, rows, lambda r: mean(r["attn_distance"]) / r["patch_size"])
    _lines(right, rows, lambda r: mean(r["attn_entropy_norm"]))
    for ax, name in ((left, "mean attention distance (patches)"), (right, "attention entropy / log(keys)")):
        _resolution_axis(ax, rows)
        ax.set_xlabel(_xlabel(rows))
        ax.set_ylabel(f"{name}, mean over layers")
        ax.grid(alpha=0.3)
    right.set_ylim(0, 1.02)
    fig.suptitle(wrapped(title, fig))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


@dataclass
class RunPlan:
    """One checkpoint of an evaluation, everything about it checked before any evaluation starts."""

    ckpt: str
    model: torch.nn.Module
    state: Dict
    cfg: Config
    ds: object
    data: str
    modes: List[str]
    routes: List[str]
    resolutions: List[Tuple[int, int]]
    controls: str
    batch: Dict[Tuple[int, int], int]  # images per batch at each size: memory bounds it


def output_dir(args: argparse.Namespace) -> Path:
    """Where results go, checked writable before any evaluation (a sweep is never lost to a bad --out). A folder made
    for the check is removed again: the first finished size makes it (:func:`write_rows`)."""
    first = Path(args.checkpoints[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    if not args.out:  # two evaluations within one second: the second gets its own directory
        base, n = out, 2
        while out.exists():
            out, n = base.with_name(f"{base.name}-{n}"), n + 1
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} exists and is not an empty directory; choose another --out")
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        if made and out.is_dir():
            out.rmdir()
        raise ConfigError(f"cannot write results to {out} ({e.strerror or e}); choose another --out") from None
    if made:  # a sweep stopped before its first size leaves no empty folder
        out.rmdir()
    return out


def plan_run(ckpt: str, args: argparse.Namespace, device: torch.device, datasets: Dict[Tuple, object]) -> RunPlan:
    """Load ``ckpt`` and its data, and check everything the evaluation will ask of it: sizes, routes, controls, the
    class names, and the memory each size needs (refused up front where one image cannot fit)."""
    if is_exported(ckpt):  # a folder python -m vitpe.export --hf (or save_pretrained) wrote
        model, state = exported_run(ckpt)
        if not state["config"]["data"].get("name") and not args.data:
            raise ConfigError(f"{ckpt} does not record the data its model was trained on; give it: --data NAME (e.g. shapes, "
                              "imagefolder:PATH)")
        if model.img_size[0] != model.img_size[1]:
            raise ConfigError(f"{ckpt} was built for {model.img_size[0]}x{model.img_size[1]} images; eval.py evaluates square-trained "
                              "models: run it in Python (vitpe.from_pretrained) at the sizes you need")
    else:
        model, state = model_from_checkpoint(ckpt, map_location="cpu", ema=not args.no_ema, verify=not args.no_verify)
    model.to(device)
    cfg = checkpoint_config(state)
    patch, train_size = model.patch_size, cfg.model.img_size
    resolutions = args.resolutions or default_resolutions(train_size, patch)
    routes = {"both": ["coords", "patch"], "all": ["coords", "patch", "resize"]}.get(args.route, [args.route])
    if "resize" in routes and trained_span(cfg):
        print(f"note: --route resize resizes every image to {train_size}x{train_size}, {ckpt}'s reference size (it was "
              f"trained at {trained_span(cfg)} too)", file=sys.stderr)
    ref_h, ref_w = model.ref_grid
    for h, w in resolutions:
        if "coords" in routes and (h % patch or w % patch):
            raise ConfigError(f"resolution {h}x{w} is not a multiple of the patch size {patch} of {ckpt}; "
                              f"use multiples of {patch}, e.g. {snap(h, patch)}")
        if "patch" in routes and args.resolutions and not patch_fits(model, h, w):  # the default sizes: the route takes those it can
            raise ConfigError(f"--route patch keeps the {ref_h}x{ref_w} token grid, so resolution {h}x{w} must be k*{ref_h} x k*{ref_w}")
    key = data_args(cfg, args.data, args.data_dir, args.test_size)
    if key not in datasets:
        datasets[key] = load_dataset(*key)
        for line in datasets[key].notes:
            print(f"note: {line}", file=sys.stderr)
    ds, name = datasets[key], key[0]
    if args.native and model.content_keep < 1:
        raise ConfigError(f"{ckpt} keeps each image's {model.content_keep:g} most contentful patches, which --native's packed "
                          "batches cannot select; evaluate it without --native")
    if args.tta in ("flip", "flip_shift") and not ds.flip_ok:
        raise ConfigError(f"{name}'s labels change under a mirror image, so --tta {args.tta} would mix classes; use --tta shift")
    if ds.in_chans != model.in_chans:
        raise ConfigError(f"{ckpt} was trained on {model.in_chans}-channel images, but {name} has {ds.in_chans}; evaluate it on "
                          f"its own dataset ({cfg.data.name})")
    for line in check_classes(state, ds, str(ckpt), f"evaluate it on data with those classes (its own: {cfg.data.name})"):
        print(f"note: {line}", file=sys.stderr)
    modes = {"checkpoint": [cfg.model.coord_mode], "both": ["interpolate", "extrapolate"], "all": list(COORD_MODES)}.get(args.coord_mode, [args.coord_mode])
    controls = " (raw weights)" if args.no_ema and state.get("ema") is not None else ""
    controls += f" [tta {args.tta}]" if args.tta != "none" else ""
    try:  # the test-time controls: a model without the encoding they act on is refused in one line
        for key, text in parse_pe_options(args.pe_options):
            set_pe_option(model, key, text)
            controls += f" [{key} {text}]"
    except ValueError as e:
        raise ConfigError(f"{ckpt} ({cfg.model.pos_embed}): {e}") from None
    new_grid = [(hw, None) for hw in resolutions if "coords" in routes or "resize" in routes]  # resize: planned as its size
    patched = [(hw, hw[0] // ref_h) for hw in resolutions if "patch" in routes and patch_fits(model, *hw)]
    return RunPlan(ckpt, model, state, cfg, ds, name, modes, routes, resolutions, controls,
                   memory_plan(model, new_grid + patched + [((train_size,) * 2, None)], args.batch_size, device, str(ckpt),
                               (train_size,) * 2))


def patch_fits(model, h: int, w: int) -> bool:
    """Whether FlexiViT's patch route reaches ``h x w``: the trained token grid with a whole patch size."""
    ref_h, ref_w = model.ref_grid
    return h % ref_h == 0 and w % ref_w == 0 and h // ref_h == w // ref_w


def sweep(plans: List[RunPlan], args: argparse.Namespace, device: torch.device, rows: List[Dict],
          on_row: Callable[[List[Dict]], None] = lambda rows: None) -> None:
    """Evaluate every plan, appending a row to ``rows`` as each size finishes and calling ``on_row(rows)`` then (an
    interrupted or killed sweep keeps them)."""
    options = parse_pe_options(args.pe_options)  # the rotary controls keep their own columns, as before they were options
    controls = {column: option_value(options, name) for column, name in (("rope_scaling", "scaling"), ("p_rope", "p_rope"))}
    for run in plans:
        model, cfg, ds = run.model, run.cfg, run.ds
        train_size = cfg.model.img_size
        dtype = amp_dtype(cfg.train.amp, device)
        variants = [(m, r) for r in run.routes for m in (run.modes if r == "coords" else run.modes[:1])]  # patch route: the trained grid
        for mode, route in variants:
            label = cfg.model.pos_embed + (f" ({mode})" if len(run.modes) > 1 or args.coord_mode != "checkpoint" else "") + run.controls
            label += {"patch": " (patch resize)", "resize": f" (image resized to {train_size})"}.get(route, "")
            if any(r["label"] == label and r["run"] != str(run.ckpt) for r in rows):
                label = f"{label} [{Path(run.ckpt).name}]"
            sizes = [hw for hw in run.resolutions if route != "patch" or patch_fits(model, *hw)]
            plan = [(mode, route, hw) for hw in sizes] + ([(mode, "native", (train_size, train_size))] if args.native and route == "coords" else [])
            for row in evaluate_at(model, ds, plan, device, dtype, run.batch, label, args.tta, args.diagnostics):
                rows.append({"run": str(run.ckpt), "label": label, "pos_embed": cfg.model.pos_embed, "data": run.data,
                             **controls,
                             "pe_options": ";".join(args.pe_options) or None, "chance": 1 / ds.num_classes,
                             "weights": "ema" if run.state.get("ema") is not None and not args.no_ema else "raw",
                             "train_size": train_size, "train_sizes": trained_span(cfg),
                             "scale": round((row["height"] * row["width"]) ** 0.5 / train_size, 4), **row})
                on_row(rows)
                if not sys.stdout.isatty():  # a log (nohup, a cluster job): a line per result, not silence until the table
                    print(f"{label} @ {row['resolution']}: top-1 {100 * row['top1']:.2f}% ({row['seconds']:.0f}s)", flush=True)


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
    plot(rows, out / "accuracy_vs_resolution.png", f"top-1 against resolution ({data})")
    if any(r.get("attn_distance") for r in rows):
        plot_attention(rows, out / "attention_vs_resolution.png", f"attention against resolution ({data}, {diagnostics} test images)")
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    parse_pe_options(args.pe_options)  # a malformed option is refused before anything is loaded
    device = resolve_device(args.device)
    datasets: Dict[Tuple, object] = {}
    given = {}
    for ckpt in args.checkpoints:  # the same checkpoint twice (RUN and RUN/checkpoint.pt): once
        given.setdefault((Path(ckpt) if is_exported(ckpt) else find_checkpoint(ckpt)).resolve(), ckpt)
    if len(given) < len(args.checkpoints):
        print(f"note: {len(args.checkpoints) - len(given)} checkpoint(s) given twice; each is evaluated once", file=sys.stderr)
    plans = [plan_run(ckpt, args, device, datasets) for ckpt in given.values()]
    out = output_dir(args)
    rows: List[Dict] = []
    stopped = 0  # the signal that stopped the sweep
    try:
        with _sigterm_stops():
            sweep(plans, args, device, rows, lambda rows: write_rows(rows, out))
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: what finished is kept (written as each size finished)
        stopped = getattr(e, "signum", signal.SIGINT)
    if not rows:
        print(f"\ninterrupted ({signal.Signals(stopped).name}) before any size finished; nothing written" if stopped else
              "\nno size to evaluate on the routes asked for; nothing written", file=sys.stderr)
        return 128 + stopped if stopped else 1
    if len({r["data"] for r in rows}) > 1:  # runs on different data share the table: each line says which
        for r in rows:
            r["label"] += f" on {r['data']}"
    try:
        summary = write_results(rows, out, args.diagnostics)
    except BaseException:  # disk full, Ctrl-C: the finished rows stay (each file is written whole), nothing half-written
        for tmp in out.glob(".*.tmp"):
            tmp.unlink()
        raise

    # The table: one row per resolution, one column per run/mode.
    labels = list(dict.fromkeys(r["label"] for r in rows))
    reso = list(dict.fromkeys(r["resolution"] for r in rows))
    width = max(12, *(len(label) + 2 for label in labels))
    print("top-1 (%) by resolution" + " " * 2 + "".join(f"{label:>{width}}" for label in labels))
    for res in reso:
        cells = []
        for label in labels:
            hit = [r for r in rows if r["label"] == label and r["resolution"] == res]
            cells.append(f"{100 * hit[0]['top1']:>{width}.2f}" if hit else f"{'-':>{width}}")
        print(f"{res:<25}" + "".join(cells))
    print()
    for r in summary:
        own = f"{100 * r['top1_at_train_size']:.2f}% at its training size {r['train_size']}, " if r["top1_at_train_size"] is not None else ""
        print(f"{r['label']}: {own}best {100 * r['best_top1']:.2f}% at {r['best_resolution']}, mean top-1 over the log scale "
              f"{r['from_resolution']}-{r['to_resolution']} {100 * r['auc_log_scale']:.2f}%")
    fmt = lambda xs: " ".join("-" if x is None else f"{x:.2f}" for x in xs)  # noqa: E731
    for r in rows:
        attn = (f"; attention distance (px) by layer {fmt(r['attn_distance'])}, entropy/log(keys) {fmt(r['attn_entropy_norm'])}"
                if r.get("attn_distance") else "")
        print(f"{r['label']} @ {r['resolution']}: {r['tokens_per_image']:g} tokens, {r['images_per_s']:.0f} img/s{attn}")
    pictures = ", ".join(str(out / f) for f in ("accuracy_vs_resolution.png", "attention_vs_resolution.png") if (out / f).exists())
    print(f"\nresults: {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.json'}, {out / 'summary.csv'}\nplots:   {pictures}")
    if stopped:
        print(f"interrupted ({signal.Signals(stopped).name}): the {len(rows)} sizes that finished are in {out}", file=sys.stderr)
        return 128 + stopped
    return 0


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM (kill, a cluster's stop) stops a sweep as Ctrl-C does, so that the finished sizes are written; the
    KeyboardInterrupt it raises carries ``signum``. Attention at large sizes runs in pieces (vitpe.vit.attend), so
    either signal is honoured within seconds."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        error = KeyboardInterrupt()
        error.signum = signum
        raise error

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)



def cli(argv: Optional[List[str]] = None) -> int:
    """The command line: errors are one line and an exit code (:func:`vitpe.errors.run_cli`)."""
    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
