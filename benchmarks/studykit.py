"""What the hand-run studies of benchmarks/ share, and the library never needs: train a run once and reuse it, park an
unfinished run for another machine, the seconds-long smoke runs of each script's ``--smoke``, and a way to change what
attention's kernel receives. The library (``vitpe``) never imports this module."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch.nn.functional as F
from torch import Tensor

from vitpe.checkpoint import CHECKPOINT_NAME, checkpoint_config, load_checkpoint
from vitpe.config import load_config
from vitpe.runs import CONFIG_NAME, METRICS_CSV, METRICS_JSONL, RunError, RunLock, config_changes
from vitpe.training import resolve_config, train

ROOT = Path(__file__).resolve().parents[1]
CONVERGED_POINTS = 0.3  # a run has converged when its test top-1 trend over the last fifth of its epochs is smaller than this, either way


@dataclass(frozen=True)
class TrainSpec:
    """A run a study trains, as :func:`vitpe.training.train` takes it: a config (a path or a shipped config's name;
    None: the main job) and ``key=value`` overrides (``vitpe train --config CONFIG --set KEY=VALUE ...``)."""

    config: Optional[str]
    overrides: Tuple[str, ...] = ()

    def plus(self, *overrides: str) -> "TrainSpec":
        """The same run with more overrides (a later one wins)."""
        return TrainSpec(self.config, (*self.overrides, *overrides))

    def named(self, run: Path) -> Tuple[Optional[str], List[str]]:
        """``(config, overrides)`` that train it into the directory ``run``."""
        return self.config, [*self.overrides, f"out_dir={run.parent}", f"name={run.name}"]


def train_or_reuse(run: Path, spec: TrainSpec, label: str) -> Path:
    """What the hand-run studies share: train ``spec`` into ``run`` once; a finished run is reused and an interrupted
    one resumed, so a study stopped half-way continues where it stopped. A run trained with another config than
    ``spec`` gives (the study's recipe changed since) is refused, never reused."""
    wanted = resolve_config(*spec.named(run))
    state = load_checkpoint(run) if (run / CHECKPOINT_NAME).is_file() else None
    stored = None
    if state is not None:
        stored = checkpoint_config(state)
    elif (run / CONFIG_NAME).is_file():  # stopped before its first checkpoint: it resumes at step 0
        stored = load_config(str(run / CONFIG_NAME))
    if stored is not None:
        changes = config_changes(stored.to_dict(), wanted.to_dict())
        if changes:
            raise SystemExit(f"run {run} was trained with another config than this study asks for ({'; '.join(changes)}): "
                             "move it away to train it again, or give the study another output directory")
        if state is not None and state["epoch"] >= stored.train.epochs:
            print(f"[{label}] reusing finished run {run}")
            return run
        print(f"[{label}] resuming {run}")
        rc = train(resume=str(run))
    else:
        rc = train(*spec.named(run))
    if rc > 128:  # the training's code for a signal: stopped at a step boundary and saved, or (a second Ctrl-C) its last save kept
        raise SystemExit(f"training {run} stopped by {signal.Signals(rc - 128).name}: run the same command again to resume "
                         "it from its last checkpoint")
    if rc != 0:
        raise SystemExit(f"training {run} failed with exit code {rc}")
    return run


def _run_files() -> Tuple[str, ...]:
    """What a run needs to go on elsewhere: its checkpoint (weights, optimiser, EMA, step), config and metrics so far."""
    return CHECKPOINT_NAME, CONFIG_NAME, METRICS_JSONL, METRICS_CSV


def _progress(run: Path) -> Optional[Tuple[int, int, int]]:
    """``(epoch, step, epochs)`` of the run's checkpoint (a checksum-verified load), None without one."""
    if not (run / CHECKPOINT_NAME).is_file():
        return None
    state = load_checkpoint(run)
    return state["epoch"], state["step"], checkpoint_config(state).train.epochs


def _copy_run_files(src: Path, dest: Path) -> None:
    """The run files of ``src`` into a fresh ``dest``, which appears whole or not at all (built beside it, renamed in)."""
    tmp, old = dest.with_name(f".{dest.name}.tmp{os.getpid()}"), dest.with_name(f".{dest.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in _run_files():
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def park_run(run: Path, parked: Path, finished: bool = False) -> bool:
    """Copy an unfinished run's checkpoint, config and metrics to ``parked``, a folder outside the repository that the
    next machine can read. Run directories go with their machine; a run longer than one machine is kept (hours of a
    study, on machines handed out per session) goes on where it stopped on the next (:func:`unpark_run`). ``finished``
    parks a finished run too (one trained but not yet evaluated: without it the next machine trains it again). False
    for a finished run otherwise or one with no checkpoint yet; :class:`RunError` for one a process is training (stop
    it first: it saves at its next step boundary)."""
    run, parked = Path(run), Path(parked)
    with RunLock(run):
        progress = _progress(run)
        if progress is None or (progress[0] >= progress[2] and not finished):
            return False
        _copy_run_files(run, parked)
    return True


def unpark_run(parked: Path, run: Path) -> bool:
    """Bring a parked run (:func:`park_run`) back into ``run`` unless ``run`` has got as far on its own; True if it did.
    The next ``train_or_reuse`` (or ``train.py --resume``) then goes on from the parked step."""
    parked, run = Path(parked), Path(run)
    theirs = _progress(parked)
    if theirs is None:
        return False
    run.mkdir(parents=True, exist_ok=True)
    with RunLock(run):
        ours = _progress(run)
        if ours is not None and ours[:2] >= theirs[:2]:
            return False
        for f in _run_files():
            if (parked / f).is_file():
                tmp = run / f".{f}.tmp{os.getpid()}"
                shutil.copy2(parked / f, tmp)
                os.replace(tmp, run / f)
    return True


def smoke_args(pe: str, *overrides: str) -> TrainSpec:
    """A smoke run: ``configs/tiny.yaml`` with ``pe`` and ``overrides`` for one epoch, seconds on a CPU (what a
    benchmark's ``--smoke`` trains and measures)."""
    return TrainSpec(str(ROOT / "configs" / "tiny.yaml"), (f"model.pos_embed={pe}", "train.epochs=1", *overrides))


def train_smoke(out: Path, pe: str, *overrides: str) -> Path:
    """Train the :func:`smoke_args` run into ``out/pe``; returns the run directory."""
    if train(*smoke_args(pe, *overrides).named(Path(out) / pe)) != 0:
        raise RunError(f"the smoke run {pe} in {out} failed to train; its log above says why")
    return Path(out) / pe


_TORCH_SDPA = F.scaled_dot_product_attention
_below: List[Callable[..., Tensor]] = []  # while an override's fn runs: what was in place before that override


def SDPA(*args, **kwargs) -> Tensor:  # noqa: N802 (it stands for the kernel)
    """The attention kernel underneath the override whose ``fn`` is running (torch's own outside any): what an
    override's ``fn`` calls to attend, so that overrides nest and a spy put in place before one still sees its calls."""
    return (_below[-1] if _below else _TORCH_SDPA)(*args, **kwargs)


@contextlib.contextmanager
def sdpa_override(fn: Callable[..., Tensor]) -> Iterator[List[int]]:
    """Inside, every call of ``torch.nn.functional.scaled_dot_product_attention`` (vitpe's attention and equipped timm
    attention both call it) goes to ``fn(q, k, v, attn_mask=..., dropout_p=...)`` instead: for studies that change what
    the kernel gets (the logits' scale, a mask over keys, a mask's layout) without touching the model; ``fn`` attends
    through :func:`SDPA`. Yields a list with one entry per call made through ``fn``, and raises on a normal exit if there
    was none: a reading taken "with the override" that never reached the attention would be a silent no-op."""
    calls: List[int] = []
    below = F.scaled_dot_product_attention

    def counted(*args, **kwargs) -> Tensor:
        calls.append(1)
        _below.append(below)
        try:
            return fn(*args, **kwargs)
        finally:
            _below.pop()

    with mock.patch.object(F, "scaled_dot_product_attention", counted):
        yield calls
    if not calls:
        raise RuntimeError("sdpa_override never reached the attention: nothing inside called scaled_dot_product_attention")


def convergence(metrics: List[Dict]) -> Dict:
    """Whether a run's test top-1 had stopped moving: the least-squares trend of its last fifth of epochs (four epochs
    at least), in points over that stretch. A trend up or down of CONVERGED_POINTS or more is not converged: a fall is a run
    still moving (or breaking), not one that has settled, and one noisy last epoch neither makes nor breaks it."""
    top1 = [m["test_top1"] for m in metrics]
    back = max(3, round(len(top1) / 5))  # four epochs at least: a trend, not the last epoch's noise
    window = top1[-(back + 1):]
    if len(window) < 4:
        gain = float("nan")
    else:
        xs = range(len(window))
        mx, my = sum(xs) / len(window), sum(window) / len(window)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, window)) / sum((x - mx) ** 2 for x in xs)
        gain = 100 * slope * back
    return {"epochs": len(top1), "last_fifth_gain_points": round(gain, 2), "converged": bool(abs(gain) < CONVERGED_POINTS),
            "last_epoch_test_top1": metrics[-1].get("test_top1"), "train_acc": metrics[-1].get("train_acc"),
            "train_wall_s": round(metrics[-1].get("wall_s", float("nan")), 1), "train_time_s": round(training_time(metrics), 1)}


def training_time(metrics: List[Dict]) -> float:
    """Seconds of training behind ``metrics``, over every process that trained the run. vitpe's ``wall_s`` counts across
    resumes, so this is the last epoch's. Runs trained before it did restart ``wall_s`` at each resume: an epoch whose
    ``wall_s`` grew by less than its own ``epoch_s`` starts a new segment, the segments are summed, and the part of the
    interrupted epoch before its stop counts at least what its ``epoch_s`` has beyond the new segment's ``wall_s``."""
    total = last = 0.0
    for m in metrics:
        wall, epoch = m.get("wall_s", float("nan")), m.get("epoch_s", 0.0)
        if wall + 1e-3 < last + epoch:
            total += last + max(0.0, epoch - wall)
        last = wall
    return total + last


def mean_sd(values: Sequence[float], digits: int = 2) -> str:
    """A table cell: the mean ± the sd over seeds (the mean alone for one seed, "-" for none)."""
    if not values:
        return "-"
    return f"{statistics.fmean(values):.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def timm_weights(out: Path, name: str) -> Path:
    """timm's model ``name`` as initialised with seed 0, saved once under ``out`` as the file ``--init-weights`` takes:
    nothing is downloaded here."""
    import timm
    import torch
    from safetensors.torch import save_file

    weights = out / f"{name}.safetensors"
    if not weights.is_file():
        torch.manual_seed(0)
        save_file({k: v.contiguous() for k, v in timm.create_model(name, pretrained=False).state_dict().items()}, str(weights))
    return weights
