"""The training loop: a run from its config to its last checkpoint, resumable at any step.

    from vitpe.training import train, resolve_config
    train("fashion_mnist", ["model.pos_embed=FAMILY", "train.epochs=5"])         # what vitpe train --config ... runs
    train(resume="runs/RUN")                                                     # on from where it stopped
    cfg = resolve_config("shapes", ["train.lr=5e-4"])                            # the config such a run would train with

config -> data -> model (from scratch or from a model, ``init.source``) -> the loop, with signals, budgets, torchrun and
the lines a finished run prints (what it learned, against the measured reference). Every run gets its own directory
(never overwritten, locked while it trains) holding config.yaml, checkpoint.pt (written atomically each epoch, and at
the next step boundary on Ctrl-C or SIGTERM) and metrics.jsonl / metrics.csv.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from vitpe.checkpoint import CHECKPOINT_NAME, CheckpointError, check_classes, load_checkpoint, load_model_state, non_finite, save_checkpoint
from vitpe.config import (
    Config,
    ConfigError,
    ModelConfig,
    apply_overrides,
    batch_at,
    budget_epochs,
    config_from_dict,
    config_path,
    load_config,
    save_config,
    schedule_text,
    shipped_configs,
    size_span,
    sizes_at,
    steps_before,
    steps_in_epoch,
    train_resolutions,
)
from vitpe.data import load_dataset, resize_images
from vitpe.data.augment import BatchAugment, crop_boxes, normalize
from vitpe.data.datasets import TRAIN_SIZES
from vitpe.data.mixed import draw_sizes, mixed_batch
from vitpe.data.shards import ShardBatches
from vitpe.data.stream import BatchLoader, DecodedCache, StepPlan, cache_slot, planned
from vitpe.engine import Heartbeat, amp_dtype, autocast, gib, memory_available, pick_cpu_amp, resolve_device, seed_step, train_step_bytes
from vitpe.errors import VitpeError, command_name
from vitpe.evaluation import evaluate
from vitpe.finetune import FINE_TUNABLE, Source, freeze, read_source, source_model_args, start_model
from vitpe.pos_embed import NO_POS_EMBED
from vitpe.runs import (  # noqa: F401 (safe_name: public name)
    CONFIG_NAME,
    LOCK_NAME,
    METRICS_CSV,
    METRICS_JSONL,
    RunError,
    RunLock,
    TensorBoardLog,
    config_changes,
    create_run_dir,
    safe_name,
    write_metrics,
)
from vitpe.vit import VisionTransformer

DEFAULT_CONFIG = shipped_configs() / "shapes.yaml"  # the main job
FINETUNE_CONFIG = DEFAULT_CONFIG.with_name("finetune.yaml")  # the default recipe of a run started from a model (--init)
# Measured results of recipes, by PE (benchmarks/accuracy.py --suite main writes it): what a finished run compares itself to.
REFERENCE_FILE = Path(__file__).resolve().parent / "reference_runs.json"
# Config keys that do not change what a recipe learns, or that a reference compares across.
_NOT_RECIPE = {"model": ("pos_embed", "pos_embed_kwargs"), "train": ("seed", "device", "dist_timeout_s", "time_limit_min"),
               "data": ("data_dir",), "": ("out_dir", "name")}


class TrainingError(VitpeError, RuntimeError):
    """Training cannot go on (e.g. the loss diverged); the message says what to do."""


def config_file(config: Optional[str] = None, overrides: Sequence[str] = ()) -> Path:
    """The config file a run reads: ``config`` (a path, or a shipped config's name), else the fine-tuning recipe for a
    run started from a model (an ``init.source`` override), else the main job."""
    if config:
        return config_path(config)
    starts_from = any(o.split("=", 1)[0].strip() == "init.source" for o in overrides)
    return FINETUNE_CONFIG if starts_from else DEFAULT_CONFIG


def resolve_config(config: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """The config a new run with ``config`` and ``overrides`` (``key=value``) trains with, as :func:`train` resolves it."""
    return resolve_run(config, overrides)[0]


def resolve_run(config: Optional[str] = None, overrides: Sequence[str] = ()) -> Tuple[Config, Optional[Source], List[str]]:
    """The config a new run trains with; for one that starts from a model (``init.source``), the source read (only
    read) and the lines that say what came from it (:func:`config_from_source`)."""
    file = config_file(config, overrides)
    cfg = load_config(str(file))
    overrides = list(overrides)
    source, lines = None, []
    rest = apply_overrides(cfg, [o for o in overrides if not o.startswith("model.")])
    if rest.init.source:  # the model's keys are the source's, changed by the command line's model.* only
        cfg = rest
        source = read_source(cfg.init.source, cfg.init.weights)
        given = set(_DATASET_KEYS) if config else {o.split("=", 1)[0].strip()[len("data."):] for o in overrides if o.startswith("data.")}
        cfg, lines = config_from_source(cfg, source, [o for o in overrides if o.startswith("model.")], file, given)
    else:
        cfg = apply_overrides(cfg, overrides)
    if cfg.train.budget_min is not None and any(o.split("=", 1)[0].strip() == "train.epochs" for o in overrides):
        raise ConfigError(f"train.epochs was given but train.budget_min={cfg.train.budget_min:g} decides the epochs; drop one "
                          "(--set train.budget_min=null trains for a fixed number of epochs)")
    return cfg, source, lines


_DATASET_KEYS = ("name", "data_dir", "train_size", "test_size")  # which data a run trained on (not how it was augmented)


def config_from_source(cfg: Config, source: Source, model_overrides: Sequence[str], config: Path, data_given: Sequence[str] = ()
                       ) -> Tuple[Config, List[str]]:
    """``cfg`` for a run that starts from ``source``: the model section is the source's architecture (the config file's
    model keys give way to it) with the command line's ``model.*`` overrides, of which only
    :data:`vitpe.finetune.FINE_TUNABLE` keys may differ from the source; which data (name, folder, sizes) are a vitpe
    run's own, but for the keys ``data_given`` names (the command line's, or all where a config file is given);
    ``init.sha256`` records the weights read (and where it was given, must match them). Returns the config and the lines
    that say so."""
    defaults = vars(ModelConfig())
    base = {k: defaults[k] if v is None and isinstance(defaults[k], dict) else v  # None: VisionTransformer's "no options"
            for k, v in source.model_args.items() if k in defaults}
    if not isinstance(base["img_size"], int):
        img = base["img_size"]
        if len(set(img)) != 1 and not any(o.startswith("model.img_size=") for o in model_overrides):
            raise ConfigError(f"{source.spec} was built for {img[0]}x{img[1]} px and vitpe's training takes a square model.img_size: "
                              f"give one with --set model.img_size=N")
        base["img_size"] = img[0]
    explicit = {o.split("=", 1)[0].strip().split(".")[1] for o in model_overrides}
    try:
        changed = apply_overrides(config_from_dict(dict(cfg.to_dict(), model=base)), list(model_overrides)).model
    except ConfigError as e:
        raise ConfigError(f"{e} (the model is {source.spec}'s: {source.describe})") from None
    args, changes = source_model_args(source, {k: getattr(changed, k) for k in explicit})
    if "img_size" not in explicit:  # the square size read above from a source built for (h, w), as timm's are
        args["img_size"] = base["img_size"]
    args = {k: defaults[k] if v is None and isinstance(defaults.get(k), dict) else v for k, v in args.items()}
    data = cfg.to_dict()["data"]
    took_data = [] if source.data is None or "name" in data_given and data["name"] != source.data.get("name") else \
        [k for k in _DATASET_KEYS if k not in data_given]
    data.update({k: source.data.get(k) for k in took_data})
    digest = source.provenance.get("sha256")
    if cfg.init.sha256 and digest and cfg.init.sha256 != digest:
        raise ConfigError(f"the weights of {source.spec} changed since this config was written (sha256 {digest[:12]}..., recorded "
                          f"{cfg.init.sha256[:12]}...): restore them, or drop init.sha256 to start from what is there now")
    new = dict(cfg.to_dict(), model={k: v for k, v in args.items() if k in defaults}, data=data,
               init=dict(cfg.to_dict()["init"], sha256=digest))
    out = config_from_dict(new)
    lines = [f"{source.spec}: {source.describe}; the architecture comes from it (the model keys of {config.name} give way; a fine-tune "
             f"may change {', '.join('model.' + k for k in FINE_TUNABLE)})",
             *source.notes, *changes]
    if took_data:
        lines.append(f"data: {out.data.name} ({', '.join(f'{k}={getattr(out.data, k)}' for k in took_data if k != 'name')}), as "
                     f"{source.spec} trained on (--data NAME for other data)")
    return out, lines


AMP_NAMES = {None: "none", torch.bfloat16: "bf16", torch.float16: "fp16"}  # a checkpoint's record of the autocast it trained with


def _cpu_amp(model: VisionTransformer, ds: Any, train_x: torch.Tensor, train_y: torch.Tensor, sizes: List[int], batch: int,
             cfg: Config, world: int, state: Optional[Dict[str, Any]], log: Callable[..., None]) -> Optional[torch.dtype]:
    """``train.amp=auto`` on a CPU: what a resumed run trained with, else bf16 autocast where a few measured steps of
    this model say it is faster (:func:`vitpe.engine.pick_cpu_amp`), at the middle of the training sizes. The probe
    changes no weight (its gradients are dropped) and every step of training seeds itself, so the run is the same."""
    if state is not None:  # a checkpoint from before the probe existed trained in fp32, as amp=auto then did on a CPU
        return torch.bfloat16 if state.get("amp") == "bf16" else None
    if world > 1:  # one decision for every process would need the process group, which does not exist yet
        log("amp=auto: fp32 under torchrun on CPUs (amp=bf16 forces bf16)")
        return None
    size = sizes[len(sizes) // 2]
    x = normalize(resize_images(train_x[:batch], (size, size)), ds.mean, ds.std)
    y = train_y[:batch]
    keep = cfg.train.token_keep

    def step(dtype: Optional[torch.dtype]) -> None:
        with autocast(torch.device("cpu"), dtype):
            logits = model(x) if keep == 1 else model(x, token_keep=keep)
        torch.nn.functional.cross_entropy(logits.float(), y).backward()
        model.zero_grad(set_to_none=True)

    dtype, line = pick_cpu_amp(step)
    log(line + f" [at {size} px, {batch} images]")
    return dtype


# data.cache=null keeps pictures decoded where a slot is this many pixels or fewer: at 32 px decoding photos takes a
# quarter of the step time, at 224 px a few percent (docs/data.md), while the file grows with the slot.
CACHE_AUTO_PIXELS = 128 * 128


def keep_decoded(cfg: Config, ds: Any, run: Path, rank: int, size: int, log: Callable[..., None]) -> Optional[DecodedCache]:
    """``data.cache``'s decision for a run whose data is read a batch at a time: a :class:`DecodedCache` of the training
    pictures in the run's folder (one file a process), or None; said in one line either way when it matters."""
    data, n = cfg.data, len(ds.split(True)[1])
    if not ds.streamed or data.cache is False or cfg.train.max_tokens is not None:  # packing cuts each picture at its own size
        return None
    slot = cache_slot(size, data.crop_scale, data.crop_ratio)
    if data.cache is None and slot[0] * slot[1] > CACHE_AUTO_PIXELS:
        return None
    need, free = DecodedCache.nbytes(n, slot), shutil.disk_usage(run).free
    if need > free // 2:
        log(f"note: data.cache: {n:,} training pictures decoded at {slot[0]}x{slot[1]} px would take {gib(need)} of the {gib(free)} "
            f"free in {run}; each is decoded at every use")
        return None
    cache = DecodedCache(run / f"decoded-{rank}.u8", n, slot)
    ds.keep_decoded(True, cache)
    log(f"data.cache: training pictures are kept decoded at {slot[0]}x{slot[1]} px in {cache.path.name} (at most {gib(need)} on disk, "
        "deleted when the run stops); after a picture's first use its crops are cut from there, not decoded (data.cache=false: decode each time)")
    return cache


def run_name(cfg: Config) -> str:
    return cfg.name or f"{cfg.data.name}-{cfg.model.pos_embed}-{time.strftime('%Y%m%d-%H%M%S')}"


def resume_state(resume: str, verify: bool = True) -> Tuple[Optional[Dict[str, Any]], Config, Path]:
    """What a resumed run continues: the checkpoint, or a run stopped before its first one (from its config, at step 0)."""
    given = Path(resume)
    run = given if given.is_dir() else given.parent
    if given.is_dir() and not (given / CHECKPOINT_NAME).exists():
        if (given / CONFIG_NAME).is_file():
            return None, load_config(str(given / CONFIG_NAME)), run
        # what a kill between mkdir and config.yaml left before run creation became atomic (create_run_dir)
        if not any(f.name != LOCK_NAME for f in given.iterdir()):
            raise RunError(f"run directory {given} is empty (it was stopped while it was being made, before any training): "
                           "nothing is lost; remove it and start the run again")
    state = load_checkpoint(resume, verify=verify)
    for key in ("optimizer", "scheduler", "epoch", "step"):
        if key not in state:
            raise CheckpointError(f"checkpoint {resume} has no '{key}' state: it can be evaluated ({command_name('eval')}) but not resumed")
    cfg = config_from_dict(state["config"])
    if (run / CONFIG_NAME).is_file():  # a checkpoint copied in from another run would train under this run's name
        changes = config_changes(load_config(str(run / CONFIG_NAME)).to_dict(), cfg.to_dict())
        if changes:
            raise CheckpointError(f"the checkpoint in {run} is not this run's: it was written with other settings than its "
                                  f"{CONFIG_NAME} ({changes[0]}{f' and {len(changes) - 1} more' if len(changes) > 1 else ''}); "
                                  f"put the run's own checkpoint back, or start a new run from that checkpoint's settings")
    return state, cfg, run


class StopRequest:
    """Ctrl-C and SIGTERM (what Slurm, Kubernetes and torchrun send) become a request to stop at the next step
    boundary, where weights, optimizer and step counter agree; a second Ctrl-C aborts at once without saving."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, log) -> None:
        self.signum = 0
        self._log = log
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            # A signal the process was started ignoring (nohup, a background job) stays ignored.
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        self._log(f"\n{signal.Signals(signum).name}: stopping after this step (Ctrl-C again to abort without saving)", file=sys.stderr)

    def agreed(self, distributed: bool, device: torch.device) -> int:
        """The signal any process received (all processes stop at the same step under torchrun)."""
        if not distributed:
            return self.signum
        flag = torch.tensor([self.signum], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


class Progress:
    """Where every process is, in the process group's store, so that a hung rank can be named."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # a private API: without it the message just names no rank
            self.store = None

    def mark(self, epoch: int, step: int, stage: int = 0) -> None:
        """``stage`` 0: at the step's start; 1: about to enter the step's gradient all-reduce."""
        if self.store is not None:
            self.store.set(f"vitpe/progress/{self.rank}", f"{epoch} {step} {stage}")

    def laggards(self) -> str:
        if self.store is None:
            return ""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=2))
            at = {r: tuple(map(int, self.store.get(f"vitpe/progress/{r}").split())) for r in range(self.world)}
        except Exception:
            return ""
        behind = [r for r, p in at.items() if p < at[self.rank]]
        if not behind:
            return ""
        return f"; rank {', '.join(map(str, behind))} stopped answering at epoch {at[behind[0]][0] + 1} step {at[behind[0]][1]}"


FEW_STEPS = 400  # optimizer steps below which a ViT trained from scratch has barely left its warm-up (the main job takes 1,248)


def recipe_work(recipe: Config) -> Optional[Tuple[int, float, str]]:
    """A recipe's work as ``(optimizer steps, warm-up steps, where they come from)``: its ``train.steps``, or its epochs
    on the data it was written for; None where that data's size is not known without reading it (an image folder)."""
    t = recipe.train
    if t.steps is not None:
        return t.steps, (t.warmup_steps if t.warmup_steps is not None else 0.05 * t.steps), f"train.steps={t.steps:,}"
    size = recipe.data.train_size or TRAIN_SIZES.get(recipe.data.name)
    if size is None:
        return None
    per_epoch = max(1, size // t.batch_size)
    return (t.epochs * per_epoch, t.warmup_epochs * per_epoch,
            f"the recipe was written for {recipe.data.name} ({t.epochs} epochs = {t.epochs * per_epoch:,} optimizer steps)")


def work_schedule(recipe: Config, cfg: Config, overrides: Sequence[str], steps_per_epoch: int, n_train: int) -> Optional[str]:
    """A schedule in optimizer steps, not epochs, where the config asks for one (``train.steps``) or the data is not what
    the recipe was written for (an epoch of a small folder is a handful of steps), unless the user chose the epochs
    (or a budget). Sets ``cfg.train.epochs`` and ``warmup_epochs`` and returns the line that says so; None where the
    epochs stand as given."""
    chosen = {o.split("=", 1)[0].strip() for o in overrides}
    if {"train.epochs", "train.budget_min"} & chosen or cfg.train.budget_min is not None:
        return None
    work = recipe_work(cfg) if cfg.train.steps is not None else recipe_work(recipe) if cfg.data.name != recipe.data.name else None
    if work is None:
        return None
    steps, warmup, source = work
    epochs = max(1, math.ceil(steps / steps_per_epoch))
    cfg.train.epochs = epochs
    if "train.warmup_epochs" not in chosen:
        cfg.train.warmup_epochs = round(warmup / steps_per_epoch, 3)
    return (f"schedule sized by work: {source}; {n_train:,} training images make {steps_per_epoch} steps an epoch, so {epochs} "
            f"epochs ({epochs * steps_per_epoch:,} steps, warm-up {cfg.train.warmup_epochs:g} epochs); --epochs N chooses")


def schedule_warnings(cfg: Config, steps_per_epoch: int, n_test: Optional[int] = None) -> List[str]:
    """What cannot work as configured in the learning-rate schedule and the EMA, or be read from the test split, in
    one line each (the run still starts)."""
    t, total = cfg.train, cfg.train.epochs * steps_per_epoch
    out = []
    if total < FEW_STEPS and not cfg.init.source:  # a fine-tune starts from a trained model: a few hundred steps are its norm
        more = math.ceil(FEW_STEPS * 3 / steps_per_epoch)
        out.append(f"{total} optimizer steps ({t.epochs} epochs x {steps_per_epoch}) are far too few for a ViT to learn from scratch "
                   f"(the main job takes 1,248): expect a score near chance or far below what the data allows; train longer "
                   f"(e.g. --epochs {more}) or lower train.batch_size")
    if n_test is not None and n_test < 200:
        spread = 100 * (0.25 / n_test) ** 0.5  # the standard error of a top-1 near 50%
        out.append(f"the test split has {n_test} images: each is {100 / n_test:.1f} points of top-1, and scores differ by about "
                   f"{spread:.0f} points between equally good models; give more test images (a test/ or val/ folder) to compare runs")
    if t.warmup_epochs >= t.epochs:
        # a train.steps run's warm-up was given in steps (train.warmup_steps, 5% by default): the key to lower is that one
        given = (f"train.warmup_steps={t.warmup_steps}" if t.warmup_steps is not None else "the default warm-up (5% of train.steps)") \
            if t.steps is not None else f"train.warmup_epochs={t.warmup_epochs:g}"
        fix = "train.warmup_steps" if t.steps is not None else "train.warmup_epochs"
        out.append(f"{given} covers the whole {t.epochs}-epoch run: the learning rate never leaves warm-up and never decays; "
                   f"lower {fix}")
    if t.ema_decay > 0:
        horizon = 1 / (1 - t.ema_decay)
        if horizon > total / 2:
            out.append(f"train.ema_decay={t.ema_decay:g} averages over about {horizon:.0f} steps but the run has {total}: the EMA "
                       "weights, on which test accuracy is measured, stay close to the random start; lower train.ema_decay, "
                       "train longer, or compare with eval.py --no-ema")
    return out


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def trend(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` per step: a climb that one noisy last epoch cannot hide."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    den = sum((i - mean_x) ** 2 for i in range(n))
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / den if den else 0.0


def undertrained_hint(rows: List[Dict[str, Any]], num_classes: int, epochs: int, budget_min: Optional[float] = None,
                      run: Optional[Path] = None) -> Optional[str]:
    """A line when a finished run's metrics say it stopped too early: training accuracy (below 97%) or test top-1
    still climbing by more than 3 points over the last epochs by their trend (a fifth of the run, at least 3; one noisy
    last epoch neither hides nor fakes a climb), or near chance. It names the command for a longer run with the same
    settings."""
    if not rows:
        return None
    last, chance = rows[-1]["test_top1"], 1 / num_classes
    more = f"--set train.budget_min={2 * budget_min:g}" if budget_min else f"--epochs {2 * epochs}"
    again = (f"{command_name('train')} --config {run / CONFIG_NAME} {more} --name {run.name}-longer" if run is not None
             else f"a new run with {more}")
    k = max(3, len(rows) // 5)
    if len(rows) >= 3:
        window = rows[-k:]
        gains = {name: 100 * trend([r[key] for r in window]) * (len(window) - 1) for name, key in (("training", "train_acc"), ("test", "test_top1"))}
        # "Far below where it was heading": a climb of several points, on a training accuracy that still has room
        # (the main job's last epochs climb from 96% to 99.5% on the training set as its cosine ends: learned, not cut).
        if (gains["training"] > 3 and window[-1]["train_acc"] < 0.97) or gains["test"] > 3:
            return (f"training accuracy rose {gains['training']:+.1f} and test top-1 {gains['test']:+.1f} points over the last {len(window)} "
                    f"epochs (their trend): the run stopped while still learning; a longer one should do better: {again}")
    elif len(rows) == 2 and last - rows[-2]["test_top1"] > 0.01:
        return (f"test top-1 still rose {100 * (last - rows[-2]['test_top1']):.1f} points in the last epoch: this run is probably "
                f"undertrained; a longer one should do better: {again}")
    if last < 1.5 * chance:
        return f"test top-1 {100 * last:.1f}% is near chance ({100 * chance:.1f}%): the model has not learned yet; train longer or raise train.lr"
    return None


def recipe_of(cfg: Config) -> Dict[str, Any]:
    """``cfg`` without the PE, the seed and where things go: two runs with the same recipe differ only in those."""
    out = cfg.to_dict()
    for section, keys in _NOT_RECIPE.items():
        node = out[section] if section else out
        for key in keys:
            node.pop(key, None)
    return out


def reference_results(cfg: Config, path: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    """The measured results (per PE) of ``cfg``'s recipe, if it is one in ``path`` (default REFERENCE_FILE); else None."""
    try:
        entries = json.loads(Path(path or REFERENCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    recipe = recipe_of(cfg)
    for e in entries:  # a recipe measured before a config key existed has that key's default
        try:
            if recipe_of(config_from_dict(e.get("recipe") or {})) == recipe:
                return e
        except ConfigError:
            continue
    return None


def position_top1(per_class: List[float], position: Sequence[int]) -> float:
    """Mean per-class top-1 over the classes that only position tells apart."""
    return statistics.fmean(per_class[c] for c in position)


def learned_lines(row: Dict[str, Any], ds, cfg: Config, reference: Optional[Dict[str, Any]] = None) -> List[str]:
    """What a finished run learned, in its data's terms: on data whose classes differ only in where things are, their
    top-1 beside the others', and the same recipe without a PE as measured (``reference``), when there is one."""
    position = ds.position_classes
    per = row.get("test_per_class_top1")
    if not position or not per:
        return []
    at = position_top1(per, position)
    rest = statistics.fmean(per[c] for c in range(len(per)) if c not in position)
    lines = [f"learned: {100 * at:.1f}% on the {len(position)} classes only position tells apart "
             f"({', '.join(ds.classes[c] for c in position)}; chance on them: {100 / len(position):.0f}%), "
             f"{100 * rest:.1f}% on the other {len(per) - len(position)} (mean per-class top-1)"]
    baseline = (reference or {}).get("results", {}).get(NO_POS_EMBED)
    if baseline and cfg.model.pos_embed != NO_POS_EMBED:
        seeds, top1, pos = baseline["seeds"], baseline["top1"], baseline["position_top1"]
        base = statistics.fmean(top1)
        lines.append(f"without a PE (pos_embed={NO_POS_EMBED}) the same recipe reached {100 * base:.1f}% ({100 * statistics.fmean(pos):.1f}% on those "
                     f"{len(position)} classes; measured {reference['measured']}, seeds {seeds}): {cfg.model.pos_embed} adds "
                     f"{100 * (row['test_top1'] - base):+.1f} points")
    return lines


def train(config: Optional[str] = None, overrides: Sequence[str] = (), *, resume: Optional[str] = None, verify: bool = True) -> int:
    """Train a run, or continue one: the library's whole main job, which ``vitpe train`` calls. ``config``: a YAML path or
    a shipped config's name (default: the main job, or the fine-tuning recipe when an ``init.source`` override is
    given); ``overrides``: ``key=value`` items (``train.epochs=5``, ``name=my-run``, ``out_dir=runs``); ``resume``: a
    run directory or checkpoint to continue exactly where it stopped (with its saved config: nothing else may be
    given); ``verify=False`` resumes from a checkpoint whose checksum does not match. Everything is checked before a
    run directory is made. Returns the exit code: 0 when done or stopped by the time limit, 128 + N when stopped by
    signal N (the checkpoint is saved: resume it), 130 when aborted; errors are :class:`vitpe.errors.VitpeError`."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    log = print if rank == 0 else (lambda *a, **k: None)

    # ---- config: everything is checked before a run directory exists ----------------------------------
    source = None  # what a new run starts from (--init): read, never written; a resumed run has its own weights
    if resume:
        if config or overrides:
            raise ConfigError("a resumed run continues with its saved config; start a new run to change settings")
        state, cfg, run = resume_state(resume, verify)
    else:
        state, run = None, None
        cfg, source, lines = resolve_run(config, overrides)
        for line in lines:
            log(f"init: {line}")
    if cfg.train.batch_size % world:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by the {world} processes")
    if (cfg.data.mixup > 0 or cfg.data.cutmix > 0) and (cfg.train.batch_size // world) % 2:
        raise ConfigError(f"mixup/cutmix pair images within a batch: train.batch_size per process ({cfg.train.batch_size // world}) must be even")
    device = resolve_device(cfg.train.device)
    dtype = amp_dtype(cfg.train.amp, device)

    # ---- data ------------------------------------------------------------------------------------
    size = (cfg.model.img_size, cfg.model.img_size)
    stream = cfg.data.stream
    if stream is None and state is not None:  # a resumed run reads its data as it began: the same pixels at every step
        stream = bool((state.get("data") or {}).get("streamed"))
    ds = load_dataset(cfg.data.name, cfg.data.data_dir, cfg.data.train_size, cfg.data.test_size, size, stream=stream)
    if cfg.data.name.startswith("imagefolder:"):  # config.yaml records the choice: a resume and eval.py read the data as the run did
        cfg.data.stream = ds.streamed
    train_x, train_y = ds.split(True, size)
    test_x, test_y = ds.split(False, size)
    notes = list(ds.notes)
    if state is not None:  # the head's rows are the checkpoint's classes, by name
        notes += check_classes(state, ds, f"checkpoint {resume}", "restore the data the run was trained on, or start a new run")
    for line in notes:
        log(f"note: {line}")
    # Multi-resolution training: shapes is rendered natively at each size once; other data is resized per batch.
    sizes = train_resolutions(cfg)
    packed = cfg.train.max_tokens is not None  # mixed sizes: each batch renders or resizes its own images (Job.batch)
    train_at = {} if packed or ds.streamed else {s: ds.split(True, (s, s))[0] if ds.renders_natively else train_x for s in sizes}
    augment = BatchAugment(cfg.data.augment, flip=ds.flip_ok)
    if cfg.data.augment == "flip" and not ds.flip_ok:
        raise ConfigError(f"{cfg.data.name}'s labels change under a mirror image, so data.augment=flip would do nothing; use "
                          "data.augment=none or crop")
    if cfg.train.eval_tta in ("flip", "flip_shift") and not ds.flip_ok:
        raise ConfigError(f"{cfg.data.name}'s labels change under a mirror image, so train.eval_tta={cfg.train.eval_tta} would mix "
                          "classes; use train.eval_tta=shift")
    steps_per_epoch = len(train_y) // cfg.train.batch_size  # before a budget or a schedule_batch=tokens stage changes it
    if steps_per_epoch == 0 or len(train_y) < max(batch_at(cfg, e, world) for e in range(cfg.train.epochs)):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is larger than the {len(train_y)} training images"
                          + (" (with train.schedule_batch=tokens, an early stage's batch holds more images)" if steps_per_epoch else ""))
    if not resume:  # a resumed run keeps the schedule its config.yaml holds
        line = work_schedule(load_config(str(config_file(config, overrides))), cfg, overrides, steps_per_epoch, len(train_y))
        if line:
            log(line)
    total_steps = steps_before(cfg, cfg.train.epochs, len(train_y), world)

    # ---- model, optimiser, schedule ----------------------------------------------------------------
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    from timm.utils import ModelEmaV3

    seed_step(cfg.train.seed)
    model_args = dict(vars(cfg.model), num_classes=ds.num_classes, in_chans=ds.in_chans)
    if source is not None:
        model, lines = start_model(source, model_args, ds.classes)
        for line in lines:
            log(f"init: {line}")
    else:
        model = VisionTransformer(**model_args)
    frozen = freeze(model, cfg.train.freeze)  # before the optimizer: frozen parameters get no state, no decay, no update
    if frozen and state is None:
        log(f"train.freeze={cfg.train.freeze}: {len(frozen)} of {len(list(model.parameters()))} parameter tensors frozen "
            f"({sum(p.numel() for p in model.parameters() if p.requires_grad):,} parameters train)")
    model = model.to(device)
    per_process = cfg.train.batch_size // world
    step_bytes, available = train_step_bytes(model, (max(sizes),) * 2, per_process), memory_available(device)
    if step_bytes > 1.5 * available:  # the plan is within 1.5x of a measured step: this one cannot fit
        fits = max((b for b in range(1, per_process) if 1.5 * available >= train_step_bytes(model, (max(sizes),) * 2, b)), default=0)
        fix = f"lower train.batch_size to {fits * world} or less" if fits else "no batch fits at this size: lower model.img_size"
        raise ConfigError(f"a training step at {max(sizes)} px needs about {gib(step_bytes)} ({per_process} images x "
                          f"{len(model.blocks)} blocks) and {device} has {gib(available)} available; {fix}, or raise "
                          "model.patch_size")
    if step_bytes > available:
        log(f"warning: a training step at {max(sizes)} px may hold up to {gib(step_bytes)} ({per_process} "
            f"images x {len(model.blocks)} blocks) and {device} has {gib(available)} available; if it runs "
            "out of memory, lower train.batch_size or model.img_size, or raise model.patch_size")
    if cfg.train.amp == "auto" and device.type == "cpu":
        dtype = _cpu_amp(model, ds, train_x, train_y, sizes, per_process, cfg, world, state, log)
    with _quiet("timm.optim._param_groups"):
        optimizer = create_optimizer_v2(model, "adamw", lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, layer_decay=cfg.train.layer_decay)
    warmup = round(cfg.train.warmup_epochs * steps_in_epoch(cfg, 0, len(train_y), world))
    budget = state.get("budget") if state is not None else None
    budget_pending = cfg.train.budget_min and not budget  # its warnings come once the budget has set the epochs
    for line in [] if budget_pending else schedule_warnings(cfg, total_steps // cfg.train.epochs, len(test_y)):
        log(f"warning: {line}")
    with _quiet("timm.scheduler.cosine_lr"):  # its "no effect" notice, said above in vitpe's words
        scheduler = CosineLRScheduler(optimizer, t_initial=max(total_steps - warmup, 1), lr_min=cfg.train.min_lr, warmup_t=warmup,
                                      warmup_lr_init=cfg.train.lr * 1e-3, warmup_prefix=True, t_in_epochs=False)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = ModelEmaV3(model, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
    mixup = None
    if cfg.data.mixup > 0 or cfg.data.cutmix > 0:
        mixup = Mixup(mixup_alpha=cfg.data.mixup, cutmix_alpha=cfg.data.cutmix, label_smoothing=cfg.train.label_smoothing, num_classes=ds.num_classes)
    criterion = SoftTargetCrossEntropy() if mixup else torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)

    epoch, step, rows, partial = 0, 0, [], {}
    if state is not None:
        load_model_state(model, state["model"], str(resume))
        try:
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {resume} has optimizer state for another model ({str(e)[:100]}); start a new run") from None
        if ema is not None:
            load_model_state(ema.module, state["ema"], str(resume))
        epoch, step, rows, partial = state["epoch"], state["step"], state["metrics"], state.get("partial_epoch") or {}
    last_saved = None if state is None else (state["epoch"], state["step"])

    # ---- run directory: only now, when everything above has been checked ---------------------------------
    if run is None:
        if rank == 0:
            run = create_run_dir(cfg.out_dir, run_name(cfg), fill=lambda d: save_config(cfg, d / CONFIG_NAME))
        if distributed:
            dist.init_process_group("gloo" if device.type != "cuda" else "nccl", timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))
            names = [str(run)]
            dist.broadcast_object_list(names, src=0)  # rank 0 chose the name (it may hold a timestamp)
            run = Path(names[0])
    elif distributed:
        dist.init_process_group("gloo" if device.type != "cuda" else "nccl", timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s))
    if distributed and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        model.to(device)
    lock = RunLock(run) if rank == 0 else None
    board = cache = None
    try:
        if lock is not None:
            lock.__enter__()
            if not (run / CONFIG_NAME).exists():
                save_config(cfg, run / CONFIG_NAME)
        if state is not None and epoch >= cfg.train.epochs:
            last = f" (test top-1 {rows[-1]['test_top1']:.4f})" if rows else ""
            log(f"{run} finished all its {cfg.train.epochs} epochs already{last}: nothing to resume. Evaluate it with {command_name('eval')} "
                f"{run}, or train longer in a new run (--epochs N)")
            return 0
        if state is not None:
            log(f"resuming {run} at epoch {epoch + 1}, step {step}/{steps_in_epoch(cfg, epoch, len(train_y), world)}")
        elif resume:
            log(f"{run} has no checkpoint yet (it stopped before its first): starting it from step 0 with its saved config")
        if rank == 0 and cfg.train.tensorboard:
            board = TensorBoardLog(run, epoch)
        cache = keep_decoded(cfg, ds, run, rank, max(sizes), log)
        return train_loop(Job(
            cfg=cfg, run=run, rank=rank, world=world, device=device, dtype=dtype, log=log, ds=ds, train_at=train_at,
            train_y=train_y, test_x=test_x, test_y=test_y, augment=augment, model=model, model_args=model_args,
            optimizer=optimizer, scheduler=scheduler, scaler=scaler, ema=ema, mixup=mixup, criterion=criterion,
            epoch=epoch, step=step, rows=rows, partial=partial,
            last_saved=last_saved, budget=budget,
            board=board,
        ))
    finally:
        if cache is not None:
            cache.close()
        if board is not None:
            board.close()
        if lock is not None:
            lock.__exit__()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


class RateProbe:
    """Training images per second over a window of steps fixed by count (the same steps on every process), after
    ``skip`` warm-up steps (allocation, compilation). ``tick`` after each step returns the rate when the window closes."""

    # 200 steps: a 40-step window misjudged a 15-minute run by -25% and +5% on a VM whose speed drifts from minute to minute.
    def __init__(self, batch_size: int, steps_left: int, skip: int = 10, window: int = 200) -> None:
        self.batch_size = batch_size
        self.skip = min(skip, steps_left // 4)
        self.end = min(self.skip + window, steps_left)
        self.done, self.t0 = 0, time.perf_counter()

    def tick(self) -> Optional[float]:
        self.done += 1
        if self.done == self.skip:
            self.t0 = time.perf_counter()
        if self.done != self.end:
            return None
        return (self.end - self.skip) * self.batch_size / (time.perf_counter() - self.t0)


@dataclass
class Tally:
    """One epoch's running sums; saved with a mid-epoch checkpoint, so a resumed epoch's metrics cover all its steps."""

    seen: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    data_s: float = 0.0
    epoch_s: float = 0.0  # before this process took the epoch over

    def saved(self, loss_sum: torch.Tensor, since: float) -> Dict[str, float]:
        return {"seen": self.seen, "correct": self.correct, "loss_sum": loss_sum.item(), "data_s": self.data_s,
                "epoch_s": self.epoch_s + time.time() - since}


@dataclass
class Job:
    """One run, where it stands (``epoch``, ``step``: completed steps of the current epoch) and its parts, as
    :func:`main` prepared them. Its methods are the named steps of training; :func:`train_loop` runs them."""

    cfg: Config
    run: Path
    rank: int
    world: int
    device: torch.device
    dtype: Optional[torch.dtype]
    log: Callable[..., None]
    ds: Any
    train_at: Dict[int, torch.Tensor]
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    augment: Any
    model: VisionTransformer
    model_args: Dict[str, Any]
    optimizer: Any
    scheduler: Any
    scaler: Any
    ema: Any
    mixup: Any
    criterion: Any
    epoch: int
    step: int
    rows: List[dict]
    partial: Dict[str, float]
    last_saved: Optional[Tuple[int, int]]
    budget: Optional[Dict[str, float]] = None  # train.budget_min's decision: the measured rate and the epochs it allows
    board: Optional[TensorBoardLog] = None  # train.tensorboard's event files (rank 0)
    loader: Optional[BatchLoader] = None  # the epoch's batches decoded ahead in DataLoader workers (data.workers)
    # The current epoch's facts (begin_epoch), read at every step; a train.resolution_schedule changes them by epoch.
    sizes: List[int] = field(init=False)  # what its batches draw their size from
    images_per_step: int = field(init=False)  # the global batch (train.schedule_batch=tokens changes it by stage)
    steps_per_epoch: int = field(init=False)
    steps_earlier: int = field(init=False)  # the optimizer steps of the epochs before it: where the cosine stands

    def __post_init__(self) -> None:
        self.begin_epoch()

    def begin_epoch(self) -> None:
        """Work out the current epoch's sizes, batch and steps once, so that no step recomputes them."""
        cfg, n = self.cfg, len(self.train_y)
        self.sizes = sizes_at(cfg, self.epoch)
        self.images_per_step = batch_at(cfg, self.epoch, self.world)
        self.steps_per_epoch = steps_in_epoch(cfg, self.epoch, n, self.world)
        self.steps_earlier = steps_before(cfg, self.epoch, n, self.world)

    def fit_budget(self, rate: float) -> None:
        """Set train.epochs to the most whole epochs whose steps fit in train.budget_min at ``rate`` images/s (one
        number for every process: rank 0's), stretch the cosine to it, and record the decision in config.yaml."""
        cfg = self.cfg
        if self.world > 1:
            shared = torch.tensor([rate], dtype=torch.float64, device=self.device)
            dist.broadcast(shared, src=0)
            rate = shared.item()
        epoch_images = self.steps_per_epoch * self.images_per_step
        epochs, seconds = budget_epochs(cfg, rate, epoch_images, 60 * cfg.train.budget_min, self.sizes)
        cfg.train.epochs = epochs
        warmup = self.scheduler.warmup_t
        self.scheduler.t_initial = max(steps_before(cfg, epochs, len(self.train_y), self.world) - warmup, 1)  # timm reads it at every step
        self.budget = {"images_per_s": rate, "epochs": epochs}
        if self.rank == 0:
            save_config(cfg, self.run / CONFIG_NAME)
        staged = (f" at {size_span(self.sizes)} px; the later sizes' rates scaled by their tokens' cost (sizes "
                  f"{schedule_text(cfg)})") if cfg.train.resolution_schedule else ""
        self.log(f"train.budget_min={cfg.train.budget_min:g}: {rate:.0f} img/s measured over this run's first steps{staged}, so "
                 f"{epochs} epochs ({seconds / 60:.1f} min of steps; evaluation after each epoch adds to it)")
        if seconds < 30 * cfg.train.budget_min:
            self.log("warning: fewer than half the budget's minutes go to steps (one epoch takes longer than the rest); "
                     "use a subset (data.train_size) or a smaller model")
        for line in schedule_warnings(cfg, steps_before(cfg, epochs, len(self.train_y), self.world) // epochs, len(self.test_y)):
            self.log(f"warning: {line}")

    def kept(self) -> str:
        """What is on disk to continue from, truthfully."""
        if self.last_saved is None:
            return f"no checkpoint was written yet; {command_name('train')} --resume {self.run} starts it again from step 0"
        e, s = self.last_saved
        at = f"after epoch {e}" if s == 0 else f"at epoch {e + 1} step {s}"
        return f"the last good checkpoint ({at}) is kept in {self.run}"

    def checkpoint(self, partial: Optional[Dict[str, float]] = None) -> None:
        """Save at (epoch, step), unless the weights are not finite: a checkpoint is always one to continue from."""
        model, ema = self.model, self.ema
        bad = non_finite(model.state_dict()) + ([] if ema is None else non_finite(ema.module.state_dict()))
        if bad:
            raise TrainingError(f"the weights became non-finite ({len(bad)} tensors, e.g. {bad[0]}) at epoch {self.epoch + 1} step {self.step}; "
                                f"{self.kept()}. Lower train.lr, keep train.grad_clip on, or use train.amp=bf16 instead of fp16")
        if self.rank == 0:
            save_checkpoint({
                "config": self.cfg.to_dict(), "model_args": self.model_args, "data": self.ds.describe(), "model": model.state_dict(),
                "ema": ema.module.state_dict() if ema is not None else None, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "epoch": self.epoch, "step": self.step,
                "metrics": self.rows, "partial_epoch": partial, "budget": self.budget, "amp": AMP_NAMES[self.dtype],
            }, self.run / CHECKPOINT_NAME)
        self.last_saved = (self.epoch, self.step)

    def crop_boxes(self, n: int) -> Optional[torch.Tensor]:
        """The step's content scale augmentation draw (``data.crop_scale``), or None when it is off: square boxes for
        data rendered at any scale, whose zoom is rendered natively."""
        data = self.cfg.data
        if data.crop_scale is None:
            return None
        return crop_boxes(n, data.crop_scale, data.crop_ratio, square=self.ds.renders_natively)

    def draw(self, perm: torch.Tensor, step: int) -> StepPlan:
        """Step ``step``'s samples, size and crop boxes, drawn from generators seeded by where the step stands in the
        run (the same on every rank): a function of the step alone, so a loader can draw it ahead and a resumed run
        draws what an uninterrupted one did. Packing draws each image's size after this (:meth:`batch`)."""
        batch = self.images_per_step
        seed_step(self.cfg.train.seed, self.epoch, step)
        idx = perm[step * batch : (step + 1) * batch]
        boxes = self.crop_boxes(len(idx))
        if self.cfg.train.max_tokens is not None:
            return StepPlan(step, idx, None, boxes)
        res = self.sizes[torch.randint(len(self.sizes), ()).item()] if len(self.sizes) > 1 else self.sizes[0]
        return StepPlan(step, idx, (res, res), boxes)

    def mine(self) -> slice:
        """This process's share of a global batch."""
        local = self.images_per_step // self.world
        return slice(self.rank * local, (self.rank + 1) * local)

    def decode(self, plan: StepPlan) -> torch.Tensor:
        """The images of ``plan`` that this process trains on, at the plan's size: what a loader's worker runs."""
        mine = self.mine() if self.ds.streamed else slice(None)  # decoding is the cost: a streamed folder decodes its share
        boxes = None if plan.boxes is None else plan.boxes[mine]
        if boxes is not None or self.ds.streamed:  # content scale augmentation: each image a random box of itself
            return self.ds.images_at(True, plan.index[mine], plan.size, boxes)
        x = self.train_at[plan.size[0]][plan.index]
        return x if x.shape[-1] == plan.size[1] else resize_images(x, plan.size)

    def batch(self, perm: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This process's share of the step's global batch: images, targets (mixed, with mixup), labels."""
        cfg, rank = self.cfg, self.rank
        plan = self.draw(perm, self.step)  # seeds the step: the global batch is augmented identically on every rank
        idx, boxes, mine = plan.index, plan.boxes, self.mine()
        if cfg.train.max_tokens is not None:  # NaViT: every image at its own size and aspect ratio, packed
            sizes = draw_sizes(len(idx), self.sizes, self.model.patch_size, self.ds.aspects(True))
            x = mixed_batch(self.ds, True, idx[mine], sizes[mine], self.model.patch_size, cfg.train.max_tokens, self.augment,
                            cfg.train.token_keep, None if boxes is None else boxes[mine]).to(self.device, non_blocking=True)
            y = self.train_y[idx][mine].to(self.device, non_blocking=True)
            seed_step(cfg.train.seed, self.epoch, self.step, rank)
            return x, y, y
        if self.ds.shards is not None:  # read in order from this process's own shards: the labels come with the pictures
            x, y = self.loader.images(self.step)
        else:
            x, y = self.loader.images(self.step) if self.loader is not None else self.decode(plan), self.train_y[idx][mine]
        if self.ds.streamed and self.world > 1:  # only this share was decoded: the augmentation still draws for the whole batch
            whole = x.new_zeros((len(idx), *x.shape[1:]))
            whole[mine] = x
            x = whole
        x = self.augment(x)[mine]
        x, y = normalize(x.to(self.device, non_blocking=True), self.ds.mean, self.ds.std), y.to(self.device, non_blocking=True)
        seed_step(cfg.train.seed, self.epoch, self.step, rank)  # per-rank: dropout, drop-path, mixup
        return (*self.mixup(x, y), y) if self.mixup is not None else (x, y, y)

    def batch_loader(self, perm: torch.Tensor) -> Optional[BatchLoader]:
        """DataLoader workers that decode the rest of the epoch's batches ahead of its steps (``data.workers``; by default
        2 for data read a batch at a time on more than 2 cores), or None: the training process reads each batch itself.
        Packing reads its own. Shards always come through a loader (0 workers: read in this process)."""
        workers = self.cfg.data.workers
        if workers is None:  # on 2 cores workers compete with the step for them: decoding in the step is faster there (docs/data.md)
            workers = 2 if self.ds.streamed and (os.cpu_count() or 1) > 2 else 0
        if self.ds.shards is not None and self.step < self.steps_per_epoch:  # shards are read in order: always through a loader
            per_rank = self.images_per_step // self.world
            return BatchLoader.over(ShardBatches(self.ds.shards, planned(functools.partial(self.draw, perm)), self.mine(), self.step,
                                                 self.steps_per_epoch, self.epoch, self.rank, self.world, per_rank, self.cfg.train.seed,
                                                 self.ds.decoded(True)), workers)
        if workers == 0 or self.cfg.train.max_tokens is not None or self.step >= self.steps_per_epoch:
            return None
        return BatchLoader(self.decode, planned(functools.partial(self.draw, perm)), self.step, self.steps_per_epoch, workers)

    def close_loader(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def update(self, net: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, progress: Optional[Progress]) -> Tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on a batch; the step counter, schedule and EMA advance with it. Returns (loss, logits)."""
        keep = self.cfg.train.token_keep
        with autocast(self.device, self.dtype):
            logits = net(x) if keep == 1 or self.cfg.train.max_tokens is not None else net(x, token_keep=keep)  # packing drops its own
            loss = self.criterion(logits.float(), target)
        self.optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress.mark(self.epoch, self.step, 1)
        self.scaler.scale(loss).backward()
        if self.cfg.train.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        self.scheduler.step_update(self.steps_earlier + self.step)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss, logits

    def finish_epoch(self, tally: Tally, loss_sum: torch.Tensor, elapsed: float, started: float) -> None:
        """Evaluate (rank 0), record the epoch's metrics, checkpoint, then write the metrics files and the log line."""
        cfg = self.cfg
        if self.rank == 0:
            test_with = functools.partial(evaluate, self.ema.module if self.ema is not None else self.model, self.test_x, self.test_y,
                                          self.ds.mean, self.ds.std, cfg.train.eval_batch_size, self.device, self.dtype)
            test = test_with()
            if not math.isfinite(test["loss"]):
                raise TrainingError(f"test loss became {test['loss']} after epoch {self.epoch + 1}; {self.kept()}. Lower train.lr")
            seen = max(tally.seen, 1)
            tta = cfg.train.eval_tta
            if tta != "none" and self.epoch + 1 == cfg.train.epochs:  # the last epoch's: per epoch it would cost a view each
                test["top1_tta"] = test_with(tta=tta)["top1"]
            self.rows.append({
                "epoch": self.epoch + 1, "train_loss": loss_sum.item() / seen, "train_acc": tally.correct / seen,
                "test_loss": test["loss"], "test_top1": test["top1"], **({"test_top5": test["top5"]} if "top5" in test else {}),
                **({f"test_top1_tta_{tta}": test["top1_tta"]} if "top1_tta" in test else {}),
                "test_per_class_top1": [round(a, 4) for a in test["per_class_top1"]], "lr": self.optimizer.param_groups[0]["lr"],
                **({"train_sizes": size_span(self.sizes)} if cfg.train.resolution_schedule else {}),
                "images_per_s": tally.seen * self.world / elapsed, "data_time_frac": tally.data_s / elapsed, "epoch_s": elapsed,
                "wall_s": time.time() - started,
            })
        self.epoch, self.step = self.epoch + 1, 0
        self.checkpoint()  # checkpoint first: metrics never run ahead of the weights
        if self.rank == 0:
            write_metrics(self.run, self.rows)
            if self.board is not None:
                self.board.write(self.rows[-1])
            r = self.rows[-1]
            weights = " (EMA weights)" if self.ema is not None else ""
            self.log(f"epoch {self.epoch}/{cfg.train.epochs}: train loss {r['train_loss']:.3f} acc {r['train_acc']:.3f} | "
                     f"test{weights} loss {r['test_loss']:.3f} top-1 {r['test_top1']:.4f} | {r['images_per_s']:.0f} img/s, "
                     f"data {100 * r['data_time_frac']:.0f}% of step time, {elapsed:.0f}s")


def train_loop(job: Job) -> int:
    """The epochs and steps of one run, from where ``job`` stands; returns the exit code."""
    from tqdm import tqdm

    cfg, run, log, world = job.cfg, job.run, job.log, job.world
    distributed = world > 1
    net = job.model
    if cfg.train.compile:
        # One static graph per training size, each compiled once: with dynamic shapes torch 2.14's inductor fails in
        # backward at the second size of a multi-resolution run (a specialised input stride).
        from torch import _dynamo

        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 2 * len(train_resolutions(cfg)) + 4)
        net = torch.compile(job.model, dynamic=False)
    if distributed:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[job.device.index] if job.device.type == "cuda" else None)
    n_params = sum(p.numel() for p in job.model.parameters())
    log(f"run {run}: {cfg.data.name} ({len(job.train_y)} train / {len(job.test_x)} test, {job.ds.num_classes} classes), "
        f"ViT {n_params / 1e6:.2f}M params, pe={cfg.model.pos_embed}, {job.device}{f' x{world}' if distributed else ''}, "
        f"amp={job.dtype}, "
        + (f"epochs to fit train.budget_min={cfg.train.budget_min:g} (measured in the first steps)" if cfg.train.budget_min and job.budget is None
           else f"{cfg.train.epochs} epochs") + f" x {job.steps_per_epoch} steps"
        + (f", sizes {schedule_text(cfg)}" if cfg.train.resolution_schedule else f", resolutions {job.sizes}" if len(job.sizes) > 1 else "")
        + (f", mixed sizes packed into rows of {cfg.train.max_tokens} tokens" if cfg.train.max_tokens else "")
        + (f", keeping {cfg.train.token_keep:g} of each image's tokens" if cfg.train.token_keep < 1 else ""))

    started = time.time()
    # wall_s counts this run's training across resumes: what earlier processes spent, up to the last finished epoch and
    # on the interrupted one, plus this process's time (the time between a stop and its resume is not counted).
    wall_origin = started - (job.rows[-1].get("wall_s", 0.0) if job.rows else 0.0) - job.partial.get("epoch_s", 0.0)
    progress = Progress(job.rank, world) if distributed else None
    with StopRequest(log) as stop:
        try:
            while job.epoch < cfg.train.epochs:
                net.train()
                job.begin_epoch()
                perm = torch.randperm(len(job.train_y), generator=torch.Generator().manual_seed(cfg.train.seed * 1009 + job.epoch))
                tally = Tally(**job.partial)  # a resumed epoch goes on counting from where it stopped
                loss_sum = torch.tensor(tally.loss_sum, device=job.device, dtype=torch.float64)
                job.partial, t_epoch = {}, time.time()
                desc = f"epoch {job.epoch + 1}/{cfg.train.epochs}"
                tty = sys.stderr.isatty()
                bar = tqdm(total=job.steps_per_epoch, initial=job.step, desc=desc, disable=job.rank != 0 or not tty, dynamic_ncols=True)
                first = job.step  # a resumed epoch: its progress lines count this session's steps
                job.loader = job.batch_loader(perm)
                probe = RateProbe(job.images_per_step, job.steps_per_epoch - first) if cfg.train.budget_min and job.budget is None else None
                beat = Heartbeat(f"{desc} step", job.steps_per_epoch - first, every=60.0, log=log, enabled=job.rank == 0 and not tty)
                while job.step < job.steps_per_epoch:
                    if progress is not None:
                        progress.mark(job.epoch, job.step)
                    signum = stop.agreed(distributed, job.device)
                    if signum:  # a step boundary: weights, optimizer and counter agree
                        bar.close()
                        job.checkpoint(tally.saved(loss_sum, t_epoch))
                        log(f"{signal.Signals(signum).name} at epoch {job.epoch + 1} step {job.step}; checkpoint saved. "
                            f"Continue with: {command_name('train')} --resume {run}")
                        return 128 + signum
                    t0 = time.time()
                    x, target, y = job.batch(perm)
                    tally.data_s += time.time() - t0
                    loss, logits = job.update(net, x, target, progress)
                    loss_sum += loss.detach().double() * len(y)
                    tally.correct += (logits.argmax(1) == y).sum().item()
                    tally.seen += len(y)
                    rate = probe.tick() if probe is not None else None
                    if rate is not None:
                        job.fit_budget(rate)
                        desc = f"epoch {job.epoch + 1}/{cfg.train.epochs}"  # the budget just decided the epoch count
                        bar.set_description(desc)
                        beat.desc = f"{desc} step"
                        probe = None
                    if job.step % 10 == 0 or job.step == job.steps_per_epoch:  # a sync every 10 steps, not every step
                        avg = loss_sum.item() / tally.seen
                        if not math.isfinite(avg):
                            raise TrainingError(f"loss became {avg} at epoch {job.epoch + 1} step {job.step}; {job.kept()}. "
                                                f"Lower train.lr, keep train.grad_clip on, or use train.amp=bf16 instead of fp16")
                        rate = f"{tally.seen * world / (time.time() - t_epoch):.0f}"
                        bar.set_postfix(loss=f"{avg:.3f}", acc=f"{tally.correct / tally.seen:.3f}", img_s=rate)
                        beat.tick(job.step - first, f" | train loss {avg:.3f} acc {tally.correct / tally.seen:.3f}, {rate} img/s")
                    bar.update(1)
                bar.close()
                job.close_loader()
                job.finish_epoch(tally, loss_sum, tally.epoch_s + time.time() - t_epoch, wall_origin)
                if distributed:
                    dist.barrier()
                limit = cfg.train.time_limit_min
                if limit is not None and time.time() - started > 60 * limit and job.epoch < cfg.train.epochs:
                    log(f"time limit of {limit} min reached after epoch {job.epoch}; continue with: {command_name('train')} --resume {run}")
                    return 0
        except KeyboardInterrupt:  # the second Ctrl-C: the state may be mid-update, so nothing is saved
            log(f"\naborted without saving; {job.kept()}")
            return 130
        except RuntimeError as e:
            text = str(e).lower()
            if distributed and not isinstance(e, TrainingError) and ("timed out" in text or "timeout" in text):
                raise TrainingError(f"rank {job.rank}: no answer from the other processes within train.dist_timeout_s="
                                    f"{cfg.train.dist_timeout_s:g}s{progress.laggards() if progress else ''}; {job.kept()}") from None
            raise
        finally:
            job.close_loader()  # a stop, an error or the end: its workers stop with it

    if job.rows:
        tta = f"test_top1_tta_{cfg.train.eval_tta}"
        log(f"done in {time.time() - started:.0f}s: test top-1 {job.rows[-1]['test_top1']:.4f}"
            + (f" ({job.rows[-1][tta]:.4f} with test-time augmentation {cfg.train.eval_tta})" if tta in job.rows[-1] else "")
            + f"{' (EMA weights; eval.py --no-ema for the raw ones)' if job.ema is not None else ''}\n"
            f"  run:        {run}\n  checkpoint: {run / CHECKPOINT_NAME}\n  metrics:    {run / METRICS_CSV} (and {METRICS_JSONL})\n"
            f"  evaluate at other resolutions: {command_name('eval')} {run}")
        for line in learned_lines(job.rows[-1], job.ds, cfg, reference_results(cfg)):
            log(line)
        hint = undertrained_hint(job.rows, job.ds.num_classes, cfg.train.epochs, cfg.train.budget_min, run)
        if hint:
            log(f"note: {hint}")
    return 0
