"""Run directories: one name per run, never overwritten, held by one process at a time; their metrics files."""
from __future__ import annotations

import csv
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .errors import VitpeError

__all__ = ["RunError", "CONFIG_NAME", "METRICS_JSONL", "METRICS_CSV",
           "safe_name", "create_run_dir", "remove_stale", "RunLock", "write_metrics", "write_csv", "pid_alive", "config_changes"]

LOCK_NAME = ".lock"
# A run directory's files besides its checkpoint (checkpoint.CHECKPOINT_NAME): one name each for training, resuming
# and parking; the tests spell them out, since they are the documented names.
CONFIG_NAME = "config.yaml"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"


class RunError(VitpeError, RuntimeError):
    """A run directory that cannot be used as asked (taken, in use, not a directory)."""


def safe_name(name: str) -> str:
    """A run name usable as a directory name ('+', ':' and '/' become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def create_run_dir(out_dir: str | Path, name: str, fill: Optional[Callable[[Path], None]] = None) -> Path:
    """Make ``out_dir/name`` for a new run; one line of error if it exists or ``out_dir`` is not a directory.
    Of two processes starting the same name exactly one gets it. ``fill(dir)`` writes the run's first files (its
    config) into a staging directory that is then renamed to the name, so a kill at any instant leaves either no run
    or one that ``--resume`` continues, never a run directory without its config."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RunError(f"out_dir {out} is a file, not a directory; give --out-dir a directory")
    if safe_name(name).strip(".") == "":  # '.', '..': the runs folder itself or its parent, never a run of its own
        raise RunError(f"run name {name!r} names a folder that is not a run's own; choose another --name (letters, digits, . _ -)")
    run = out / safe_name(name)
    taken = RunError(f"run directory {run} already exists; continue it with --resume {run}, or pick another --name")
    out.mkdir(parents=True, exist_ok=True)
    if fill is None:  # mkdir is atomic and refuses an existing name
        try:
            run.mkdir()
        except FileExistsError:
            raise taken from None
        return run
    if run.exists():
        raise taken
    prefix = f".{run.name}.new"
    remove_stale(out, prefix)
    staging = out / f"{prefix}{os.getpid()}"
    try:
        staging.mkdir()
        fill(staging)
        # rename refuses a non-empty target (config.yaml is in every created run), so the race stays one winner
        os.rename(staging, run)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise taken from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return run


def remove_stale(parent: Path, prefix: str) -> None:
    """Leftovers ``PREFIXpid`` in ``parent`` of writes that a kill interrupted, whose process is gone: checkpoint
    temporaries (files) and run staging directories alike. Only ``PREFIX`` followed by digits is ours: the glob also
    matches the staging directory of a run whose name extends this one (``.a.new1.newPID`` for ``.a.new``), which
    belongs to that run's creator and is left alone."""
    for stale in parent.glob(f"{prefix}*"):
        pid = stale.name[len(prefix):]
        if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """An exclusive lock on a run directory for as long as a process trains it (``fcntl.flock``: the kernel
    drops it when the process dies, however it dies). A second process gets :class:`RunError` naming the holder."""

    def __init__(self, run: Path) -> None:
        self.path = Path(run) / LOCK_NAME
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise RunError(f"run {self.path.parent} is in use by process {holder}; wait for it to finish or stop it, then --resume") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (it says nothing without the lock)
            self._fd = None


def write_csv(rows: List[dict], path: Path) -> None:
    """``rows`` as a CSV (columns: every key in first-seen order; list and dict values, e.g. per-class accuracies,
    left to the JSON), written atomically."""
    path = Path(path)
    flat = [{k: v for k, v in r.items() if not isinstance(v, (list, dict))} for r in rows]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
        w.writeheader()
        w.writerows(flat)
    os.replace(tmp, path)


def write_json(value: Any, path: Path) -> None:
    """``value`` as indented JSON at ``path``, written atomically (beside it, then renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def write_metrics(run: Path, rows: List[dict]) -> None:
    """Rewrite metrics.jsonl and metrics.csv from all epochs so far (small, and exact after a resume), atomically."""
    tmp = run / f".{METRICS_JSONL}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, run / METRICS_JSONL)
    write_csv(rows, run / METRICS_CSV)


TENSORBOARD_DIR = "tensorboard"  # the run's TensorBoard event files (train.tensorboard)
# metrics.jsonl's columns -> TensorBoard's tags: the curves a reader compares across runs
TENSORBOARD_TAGS = {"train_loss": "train/loss", "train_acc": "train/accuracy", "test_loss": "test/loss", "test_top1": "test/top1",
                    "test_top5": "test/top5", "lr": "train/lr", "images_per_s": "speed/images_per_s", "epoch_s": "speed/epoch_s"}


class TensorBoardLog:
    """Each finished epoch's metrics as TensorBoard scalars in ``RUN/tensorboard`` (step = epoch), beside metrics.jsonl.
    A resumed run starts a new event file and drops what the old ones hold from its first epoch on (``purge_step``),
    so the curves show each epoch once."""

    def __init__(self, run: Path, first_epoch: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run / TENSORBOARD_DIR), purge_step=first_epoch + 1)

    def write(self, row: Dict[str, Any]) -> None:
        for key, tag in TENSORBOARD_TAGS.items():
            if isinstance(row.get(key), (int, float)):
                self.writer.add_scalar(tag, row[key], row["epoch"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def config_changes(stored: Dict[str, Any], wanted: Dict[str, Any], prefix: str = "") -> List[str]:
    """``key: stored -> wanted`` for every config value (nested dicts flattened to dotted keys) that differs; the run's
    name and place are not part of what it trained, a ``train.budget_min`` run's epochs are its budget's decision, and a
    ``train.steps`` run's epochs and warm-up are what its steps came to on its data (train.py writes them at the start)."""
    out = []
    for key in dict.fromkeys([*stored, *wanted]):
        dotted, a, b = prefix + key, stored.get(key), wanted.get(key)
        decided = (wanted.get("budget_min") is not None and dotted == "train.epochs") or \
            (wanted.get("steps") is not None and dotted in ("train.epochs", "train.warmup_epochs"))
        if dotted in ("name", "out_dir") or decided:
            continue
        if not prefix and isinstance(a, dict) and isinstance(b, dict):  # a section: model, data, train
            out += config_changes(a, b, dotted + ".")
        elif a != b:
            out.append(f"{dotted}: {a!r} -> {b!r}")
    return out
