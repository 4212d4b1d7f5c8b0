"""What the hand-run studies share: train a run once, resume it if interrupted, reuse it when finished."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train as train_script  # noqa: E402
from vitpe.checkpoint import load_checkpoint  # noqa: E402


def train_or_reuse(run: Path, args: List[str], label: str) -> Path:
    """Train ``python train.py ARGS --out-dir run.parent --name run.name``; a finished run is reused and an
    interrupted one resumed, so a study stopped half-way continues where it stopped."""
    if (run / "checkpoint.pt").is_file():
        state = load_checkpoint(run)
        if state["epoch"] >= state["config"]["train"]["epochs"]:
            print(f"[{label}] reusing finished run {run}")
            return run
        print(f"[{label}] resuming {run}")
        rc = train_script.main(["--resume", str(run)])
    else:
        rc = train_script.main([*args, "--out-dir", str(run.parent), "--name", run.name])
    if rc != 0:
        raise SystemExit(f"training {run} failed with exit code {rc}")
    return run
