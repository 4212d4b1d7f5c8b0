"""``vitpe eval`` (``python eval.py`` in a clone): trained runs and exported models at several resolutions, as a table,
JSON, CSV and plots.

    vitpe eval runs/RUN                                            # 0.5x .. 2x the training size, 1:2 and 2:1
    vitpe eval runs/A runs/B --resolutions 16 32 48 64 128         # compare runs on one table and plot
    vitpe eval runs/A --resolutions 32x48 --coord-mode both       # non-square; both coordinate modes
    vitpe eval runs/A --resolutions 32 64 128 --route both         # new grid, or FlexiViT's resized patches
    vitpe eval runs/A --native                                     # also every image at its own aspect ratio
    vitpe eval runs/A --coord-mode extrapolate --rope-scaling yarn # RoPE extrapolation: pi, ntk or yarn
    vitpe eval runs/A --plan 64 48x96                              # which route at these sizes: measured, chosen, saved
    vitpe eval runs/A --plan 64 --finetune-min 3                   # ... and a 3-minute fine-tune at 64 px among them

``--plan`` measures every route the run supports at each size on its held-out data (or --data's): new coordinates in
each coordinate mode that gives the model its own coordinates at its own size, FlexiViT's patch route, the image
resized back, and with --finetune-min a fine-tune at the size (train.py --init, beside the run). It prints the answer
first (the route to use at each size, top-1 with its 95% interval, images/s), then every route's top-1, images/s at
batch 64, latency of one image and peak memory, and saves the plan in the run (route_plan.json, vitpe.route_plan).
From then on ``--route auto`` (the default where the run has a plan) takes the plan's route at those sizes, and so do
``vitpe predict`` and ``vitpe export --size``; a plan of another checkpoint or of other held-out data is refused.

The model is rebuilt from the checkpoint alone. ``shapes`` is rendered natively at each resolution;
other data is resized (antialiased). Results go to RUN/eval-TIMESTAMP/ (or --out): results.json and
results.csv (a row per size: top-1, tokens, images/s, each layer's attention distance and entropy),
summary.json and summary.csv (per run and mode: the best size and the mean top-1 over the log scale),
accuracy_vs_resolution.png and attention_vs_resolution.png. Everything is checked (sizes, routes, options, classes,
memory) before the first size is evaluated; each size's row is written as it finishes.
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
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..checkpoint import check_classes, checkpoint_config, find_checkpoint, model_from_checkpoint
from ..config import Config, ConfigError, schedule_text
from ..coords import COORD_MODES, snap
from ..data import load_dataset
from ..data.augment import TTA_MODES
from ..engine import amp_dtype, memory_plan, resolve_device
from ..evaluation import data_args, default_resolutions, evaluate_at, patch_fits, trained_span, write_results, write_rows
from ..pos_embed import PEOption, pe_test_options, set_pe_option
from ..route_plan import (
    PLAN_NAME,
    PlanError,
    Route,
    answer_lines,
    finetune_command,
    held_out_fingerprint,
    measure_cost,
    plan_path,
    plan_routes,
    plan_row,
    planned_route,
    report_lines,
    save_plan,
    size_key,
    weights_of,
)
from ..suggest import did_you_mean
from ..timm.pretrained import exported_run, is_exported
from .common import count, parse_size, positive_int, run_cli

__all__ = ["main", "cli", "parse_args", "option_flags", "parse_pe_options", "option_value"]

DIAGNOSTIC_IMAGES = 64


def minutes(text: str) -> float:
    """An argparse type: a positive, finite number of minutes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"a fine-tune budget must be a positive number of minutes, got {text}")
    return value


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", metavar="RUN_OR_EXPORT",
                   help="runs (runs/NAME), their checkpoint.pt, or folders vitpe export --hf wrote")
    p.add_argument("--resolutions", nargs="+", type=parse_size, metavar="N|HxW",
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
    p.add_argument("--route", choices=["auto", "coords", "patch", "resize", "both", "all"], default=None,
                   help="meet a new resolution with new coordinates on a new token grid (coords), by resizing the patch "
                        "embedding to keep the trained grid (patch: FlexiViT's PI-resize), or by resizing the image back to "
                        "the model's own size (resize: the baseline); both: coords and patch; all: the three; auto: at each size "
                        "the route the run's plan chose (--plan), coords where it has none (default: auto where the run has a "
                        "plan and no --coord-mode is given, else coords)")
    p.add_argument("--plan", nargs="+", type=parse_size, metavar="N|HxW",
                   help="measure every route the run supports at these sizes on its held-out data (or --data's), choose one per "
                        f"size, and save the choice in the run ({PLAN_NAME}) for --route auto, predict and export")
    p.add_argument("--finetune-min", type=minutes, metavar="M",
                   help="with --plan: also fine-tune the run at each square size for M minutes (train.py --init) and measure it")
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
    auto: Optional[Dict[Tuple[int, int], Route]] = None  # --route auto: the route at each size (the plan's, else coords)


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
    if is_exported(ckpt):  # a folder vitpe export --hf (or save_pretrained) wrote
        model, state = exported_run(ckpt)
        if not state["config"]["data"].get("name") and not args.data:
            raise ConfigError(f"{ckpt} does not record the data its model was trained on; give it: --data NAME (e.g. shapes, "
                              "imagefolder:PATH)")
        if model.img_size[0] != model.img_size[1]:
            raise ConfigError(f"{ckpt} was built for {model.img_size[0]}x{model.img_size[1]} images; vitpe eval evaluates square-trained "
                              "models: run it in Python (vitpe.from_pretrained) at the sizes you need")
    else:
        model, state = model_from_checkpoint(ckpt, map_location="cpu", ema=not args.no_ema, verify=not args.no_verify)
    model.to(device)
    cfg = checkpoint_config(state)
    patch, train_size = model.patch_size, cfg.model.img_size
    resolutions = args.plan or args.resolutions or default_resolutions(train_size, patch)
    route = route_asked(args, ckpt)
    routes = {"both": ["coords", "patch"], "all": ["coords", "patch", "resize"], "auto": ["coords"]}.get(route, [route])
    if "resize" in routes and trained_span(cfg) and not args.plan:
        print(f"note: --route resize resizes every image to {train_size}x{train_size}, {ckpt}'s reference size (it was "
              f"trained at {trained_span(cfg)} too)", file=sys.stderr)
    ref_h, ref_w = model.ref_grid
    for h, w in resolutions:
        if "coords" in routes and (h % patch or w % patch):
            raise ConfigError(f"resolution {h}x{w} is not a multiple of the patch size {patch} of {ckpt}; "
                              f"use multiples of {patch}, e.g. {snap(h, patch)}")
        if "patch" in routes and args.resolutions and not args.plan and not patch_fits(model, h, w):  # default sizes, a plan: where it can
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
    auto = None
    if route == "auto":  # each size's route: the plan's (checked against this checkpoint and data), else coords
        weights = weights_of(state, not args.no_ema)
        fingerprint = _once(lambda: held_out_fingerprint(ds))
        auto = {hw: planned_route(ckpt, state, hw, weights, fingerprint) or Route("coords", modes[0]) for hw in resolutions}
        routes = list(dict.fromkeys(r.kind for r in auto.values()))
    new_grid = [(hw, None) for hw in resolutions if "coords" in routes or "resize" in routes]  # resize: planned as its size
    patched = [(hw, hw[0] // ref_h) for hw in resolutions if "patch" in routes and patch_fits(model, *hw)]
    return RunPlan(ckpt, model, state, cfg, ds, name, modes, routes, resolutions, controls,
                   memory_plan(model, new_grid + patched + [((train_size,) * 2, None)], args.batch_size, device, str(ckpt),
                               (train_size,) * 2), auto)


def route_asked(args: argparse.Namespace, ckpt: str) -> str:
    """The route a sweep takes: the one given; else auto where the run has a plan (and no --coord-mode asks for the
    coordinate route), else coords. A plan measures every route: "all"."""
    if args.plan:
        return "all"
    if args.route:
        return args.route
    has_plan = not is_exported(ckpt) and plan_path(ckpt).is_file()
    return "auto" if has_plan and args.coord_mode == "checkpoint" else "coords"


def _once(make: Callable[[], str]) -> Callable[[], str]:
    """``make`` called at most once (a split's fingerprint, asked for at each planned size)."""
    done: List[str] = []
    return lambda: done[0] if done else (done.append(make()) or done[0])


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
        for mode, route in variants if run.auto is None else [(run.modes[0], "auto")]:
            label = cfg.model.pos_embed + (f" ({mode})" if len(run.modes) > 1 or args.coord_mode != "checkpoint" else "") + run.controls
            label += {"patch": " (patch resize)", "resize": f" (image resized to {train_size})", "auto": " (planned route)"}.get(route, "")
            if any(r["label"] == label and r["run"] != str(run.ckpt) for r in rows):
                label = f"{label} [{Path(run.ckpt).name}]"
            if run.auto is not None:
                plan = [(r.coord_mode, r.kind, hw) for hw, r in run.auto.items()]
            else:
                sizes = [hw for hw in run.resolutions if route != "patch" or patch_fits(model, *hw)]
                plan = [(mode, route, hw) for hw in sizes]
            plan += [(mode, "native", (train_size, train_size))] if args.native and route in ("coords", "auto") else []
            for row in evaluate_at(model, ds, plan, device, dtype, run.batch, label, args.tta, args.diagnostics):
                rows.append({"run": str(run.ckpt), "label": label, "pos_embed": cfg.model.pos_embed, "data": run.data,
                             **controls,
                             "pe_options": ";".join(args.pe_options) or None, "chance": 1 / ds.num_classes,
                             "weights": weights_of(run.state, not args.no_ema),
                             "train_size": train_size, "train_sizes": trained_span(cfg), "train_schedule": schedule_text(cfg),
                             "scale": round((row["height"] * row["width"]) ** 0.5 / train_size, 4), **row,
                             **({"planned_route": run.auto[(row["height"], row["width"])].name} if route == "auto" and row["route"] != "native" else {})})
                on_row(rows)
                if not sys.stdout.isatty():  # a log (nohup, a cluster job): a line per result, not silence until the table
                    print(f"{label} @ {row['resolution']}: top-1 {100 * row['top1']:.2f}% ({row['seconds']:.0f}s)", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    parse_pe_options(args.pe_options)  # a malformed option is refused before anything is loaded
    device = resolve_device(args.device)
    if args.plan or args.finetune_min:
        return plan_command(args, device)
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
        how = f" by {r['planned_route']}" if r.get("planned_route") else ""
        print(f"{r['label']} @ {r['resolution']}{how}: {r['tokens_per_image']:g} tokens, {r['images_per_s']:.0f} img/s{attn}")
    pictures = ", ".join(str(out / f) for f in ("accuracy_vs_resolution.png", "attention_vs_resolution.png") if (out / f).exists())
    print(f"\nresults: {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.json'}, {out / 'summary.csv'}\nplots:   {pictures}")
    if stopped:
        print(f"interrupted ({signal.Signals(stopped).name}): the {len(rows)} sizes that finished are in {out}", file=sys.stderr)
        return 128 + stopped
    return 0


def plan_command(args: argparse.Namespace, device: torch.device) -> int:
    """``--plan SIZES``: every route of one run at each size on held-out data, the answer first, then the table; the
    plan saved in the run (:mod:`vitpe.route_plan`)."""
    if not args.plan:
        raise ConfigError("--finetune-min is a budget for the planner's fine-tune: give the sizes too, e.g. --plan 64 --finetune-min 3")
    if len(args.checkpoints) != 1 or is_exported(args.checkpoints[0]):
        raise ConfigError("--plan measures one run: give its folder (runs/NAME), the plan is saved there; an exported folder "
                          "ships the route its run chose")
    for flag, given in (("--route", args.route), ("--resolutions", args.resolutions), ("--native", args.native),
                        ("--tta", args.tta != "none"), ("--coord-mode", args.coord_mode != "checkpoint"), ("--out", args.out)):
        if given:
            raise ConfigError(f"--plan measures every route and coordinate mode at its own sizes; drop {flag}")
    ckpt = args.checkpoints[0]
    run = plan_run(ckpt, args, device, {})
    if run.controls.strip():
        raise ConfigError(f"--plan measures the run as trained; drop the test-time options ({run.controls.strip()})")
    weights = weights_of(run.state, not args.no_ema)
    dtype = amp_dtype(run.cfg.train.amp, device)
    run_dir = find_checkpoint(ckpt).parent
    finetune = None
    if args.finetune_min:
        finetune = lambda size: finetune_row(run_dir, run, size, args.finetune_min, device, dtype)  # noqa: E731
    print(f"measuring every route of {ckpt} at {' '.join(size_key(s) for s in args.plan)} on {len(run.ds.split(False)[1]):,} "
          f"held-out images of {run.data}" + (f", and a {args.finetune_min:g}-minute fine-tune at each square size" if finetune else ""),
          file=sys.stderr)
    t0 = time.time()
    say = lambda key, row: print(f"  {key}: {row['route']} top-1 {100 * row['top1']:.2f}%, {row['images_per_s']:,.0f} img/s", file=sys.stderr)  # noqa: E731
    try:
        with _sigterm_stops():
            plan = plan_routes(run.model, run.state, run.ds, args.plan, device, dtype, weights, run.batch, finetune, say, desc=str(ckpt))
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: a plan is whole or not written (a fine-tune's run keeps its checkpoint)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\ninterrupted ({signal.Signals(signum).name}) before every route was measured; no plan written, "
              f"{PLAN_NAME} unchanged", file=sys.stderr)
        return 128 + signum
    path = save_plan(run_dir, plan)
    print("\n".join(answer_lines(plan)))
    print()
    print("\n".join(report_lines(plan)))
    print(f"\nplan: {path} ({time.time() - t0:.0f} s); eval.py, predict and export now take the chosen route at these sizes "
          "(--route auto)")
    return 0


def finetune_row(run_dir: Path, run: RunPlan, size: Tuple[int, int], budget: float, device: torch.device,
                 dtype: Optional[torch.dtype]) -> Optional[Dict]:
    """The planner's fine-tune at a square ``size``: ``train.py --init RUN`` at that size for ``budget`` minutes, beside
    the run, then measured as the other routes are (its minutes, command and run folder in the row)."""
    from ..training import train

    if size[0] != size[1]:
        print(f"note: no fine-tune at {size_key(size)}: the fine-tune trains at square sizes", file=sys.stderr)
        return None
    name, n = f"{run_dir.name}-ft{size[0]}", 2
    while (run_dir.parent / name).exists():
        name, n = f"{run_dir.name}-ft{size[0]}-{n}", n + 1
    overrides, command = finetune_command(run_dir, size, budget, run_dir.parent, name)
    print(f"fine-tune at {size[0]} px: {command}", file=sys.stderr)
    t0 = time.time()
    if train(None, overrides) != 0:
        raise PlanError(f"the fine-tune at {size[0]} px did not finish (see its log in {run_dir.parent / name}); run the planner "
                        "without --finetune-min, or fix the fine-tune")
    spent = (time.time() - t0) / 60
    if spent > 1.2 * budget:
        print(f"note: the fine-tune at {size[0]} px took {spent:.1f} minutes for a {budget:g}-minute budget: train.budget_min "
              "trains whole epochs of the run's data (data.train_size smaller makes them shorter)", file=sys.stderr)
    model, state = model_from_checkpoint(run_dir.parent / name, map_location="cpu")
    model.to(device)
    check_classes(state, run.ds, name, "")
    route = Route("coords", model.coord_mode)
    result = next(evaluate_at(model, run.ds, [(route.coord_mode, "coords", size)], device, dtype, run.batch, name, diagnostics=0))
    return plan_row("finetune", result, measure_cost(model, route, size, device, dtype), minutes=round(spent, 2),
                    command=command, run=str(run_dir.parent / name))


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
    """The command: errors are one line and an exit code (:func:`vitpe.cli.common.run_cli`)."""
    return run_cli(main, argv)
