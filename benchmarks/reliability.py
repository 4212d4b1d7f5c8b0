#!/usr/bin/env python
"""Kill, interrupt and terminate training runs at random instants, resume them, and count what survived.

    nice python -m benchmarks.reliability                    # 20 trials each of kill -9, Ctrl-C (SIGINT), SIGTERM
    python -m benchmarks.reliability --trials 1 --smoke      # a minute: 1-epoch runs in a temporary folder (the tests run it)

Each trial starts ``train.py`` on the tiny config (a few seconds of training), sends the signal after a delay
drawn uniformly from half a second before the reference run started training (while the run directory is
made) to the moment it wrote its last checkpoint, then resumes the run (``--resume``; or starts it again
when the signal came before its directory existed) until it finishes. A trial counts as

- *intact* when what the signal left is a checkpoint that loads and passes its checksum, or a run directory
  that ``--resume`` starts from its config (stopped before its first checkpoint), or nothing at all;
- *bit-exact* when the resumed run's final weights are ``torch.equal`` to an uninterrupted run's.

Results are written after every trial to ``docs/reliability/campaign.json`` and ``.md``; a stopped campaign
continues where it stopped (finished trials are kept). A campaign with other ``--epochs`` is refused, not replaced.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vitpe.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from vitpe.runs import CONFIG_NAME

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = {"kill -9": signal.SIGKILL, "Ctrl-C": signal.SIGINT, "SIGTERM": signal.SIGTERM}


def train_process(args: list) -> dict:
    """``subprocess.run`` / ``Popen`` keywords for train.py as every run of a campaign starts it: this checkout's
    package, its output merged and unbuffered (the reference run's lines are timed as they are printed)."""
    return dict(args=[sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})


def run_train(args: list, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(**train_process(args), timeout=timeout)


def weights(run: Path) -> dict:
    return load_checkpoint(run)["model"]


def trial(kind: str, delay: float, run: Path, train_args: list) -> dict:
    # A campaign started in the background inherits an ignored SIGINT, and so would train.py (it keeps ignoring a
    # signal it was started ignoring): give it the default, as a terminal's Ctrl-C finds it.
    p = subprocess.Popen(**train_process([*train_args, "--out-dir", str(run.parent), "--name", run.name]),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    finished_first = p.poll() is not None
    if not finished_first:
        p.send_signal(SIGNALS[kind])
    out, _ = p.communicate(timeout=600)
    row = {"kind": kind, "delay_s": round(delay, 2), "returncode": p.returncode, "finished_before_signal": finished_first}
    if not run.exists():
        row["left"] = "nothing (signal before the run directory existed)"
        row["intact"] = True
        resumed = run_train([*train_args, "--out-dir", str(run.parent), "--name", run.name])
    elif not (run / CHECKPOINT_NAME).exists():
        row["left"] = "config only (before the first checkpoint)"
        row["intact"] = (run / CONFIG_NAME).is_file()
        resumed = run_train(["--resume", str(run)])
    else:
        try:
            state = load_checkpoint(run)
            row["left"] = f"checkpoint at epoch {state['epoch']} step {state['step']}"
            row["intact"] = True
        except CheckpointError as e:
            row["left"], row["intact"] = f"broken checkpoint: {e}", False
        resumed = run_train(["--resume", str(run)]) if row["intact"] else None
    row["resume_returncode"] = None if resumed is None else resumed.returncode
    # checkpoint temporaries in the run, and staging directories of its creation beside it (vitpe.runs.create_run_dir)
    row["leftover_temporaries"] = len([*run.glob(f".{CHECKPOINT_NAME}.tmp*"), *run.parent.glob(f".{run.name}.new*")])
    return row


def summarise(state: dict) -> str:
    rows = state["rows"]
    # What else loaded the machine is measured, not assumed: the load average before the campaign's first process.
    load = state.get("load_before")
    beside = "" if load is None else f"; 1-minute load average {load:.2f} before the reference run started"
    lines = ["# Reliability campaign", "",
             f"{len(rows)} trials on the tiny config with --epochs {state['epochs']} (reference run {state['reference_s']:.1f} s wall, "
             f"including start-up; signals drawn uniformly from 0.5 s before training starts to its last checkpoint); "
             f"torch {torch.__version__}, {os.cpu_count()} CPU cores{beside}.", "",
             "| signal | trials | stopped by it | finished before it | intact afterwards | resumed bit-exactly | temporaries left |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind in SIGNALS:
        r = [x for x in rows if x["kind"] == kind]
        if r:
            lines.append(f"| {kind} | {len(r)} | {sum(x['returncode'] != 0 for x in r)} | {sum(x['finished_before_signal'] for x in r)} | "
                         f"{sum(x['intact'] for x in r)} | "
                         f"{sum(x['bit_exact'] for x in r)} | {sum(x['leftover_temporaries'] for x in r)} |")
    def where(x: dict) -> str:
        if x["finished_before_signal"]:
            return "after the run had finished"
        if x["left"].startswith("checkpoint"):
            return "mid-epoch (checkpoint at a step)" if not x["left"].endswith("step 0") else "checkpoint at an epoch's end"
        return x["left"]

    places = {}
    for x in rows:
        places[where(x)] = places.get(where(x), 0) + 1
    lines += ["", "What the signals left: " + "; ".join(f"{k}: {v}" for k, v in sorted(places.items(), key=lambda kv: -kv[1])) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="trials per signal")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="where campaign.json/.md and the runs go (default: docs/reliability; with --smoke a "
                                 "temporary folder, so a smoke check never touches the committed campaign)")
    p.add_argument("--smoke", action="store_true", help="1-epoch runs: a check that the campaign runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.epochs = 1
    out = Path(args.out or (tempfile.mkdtemp(prefix="vitpe-reliability-smoke-") if args.smoke else ROOT / "docs" / "reliability"))
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    train_args = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--epochs", str(args.epochs), "--set", "train.device=cpu"]
    results = out / "campaign.json"
    state = json.loads(results.read_text()) if results.exists() else {"epochs": args.epochs, "rows": []}
    if state.get("epochs") != args.epochs:  # its trials would be lost: another campaign goes elsewhere
        raise SystemExit(f"{results} holds a campaign with --epochs {state.get('epochs')} ({len(state.get('rows', []))} trials): "
                         f"continue it with --epochs {state.get('epochs')}, or give this one its own folder with --out DIR")

    reference = work / f"reference-e{args.epochs}"
    if not (reference / CHECKPOINT_NAME).exists() or "end_s" not in state:
        if reference.exists():
            shutil.rmtree(reference)
        if hasattr(os, "getloadavg"):
            state["load_before"] = round(os.getloadavg()[0], 2)
        t0 = time.time()
        proc = subprocess.Popen(**train_process([*train_args, "--out-dir", str(work), "--name", reference.name]))
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("run "):
                state["start_s"] = time.time() - t0  # imports and data done: training starts
            if line.startswith("done in"):
                state["end_s"] = time.time() - t0  # the last checkpoint is written
        if proc.wait():
            raise SystemExit(f"the uninterrupted reference run failed (exit {proc.returncode}), so no trial can be compared "
                             f"with it; its last lines:\n{''.join(lines[-5:])}")
        state["reference_s"] = time.time() - t0
    ref = weights(reference)
    rng = random.Random(args.seed)
    plan = [(kind, i) for i in range(args.trials) for kind in SIGNALS]
    done = {(r["kind"], r["trial"]) for r in state["rows"]}
    from tqdm import tqdm

    for kind, i in tqdm(plan, desc="trials", disable=not sys.stderr.isatty()):
        delay = rng.uniform(state["start_s"] - 0.5, state["end_s"])  # drawn for every trial: a resumed campaign keeps its plan
        if (kind, i) in done:
            continue
        run = work / f"{kind.replace(' ', '').replace('-', '')}-{i}"
        if run.exists():
            shutil.rmtree(run)
        row = trial(kind, delay, run, train_args)
        row["trial"] = i
        final = weights(run) if row["resume_returncode"] == 0 else None
        row["bit_exact"] = final is not None and final.keys() == ref.keys() and all(torch.equal(final[k], ref[k]) for k in ref)
        state["rows"].append(row)
        results.write_text(json.dumps(state, indent=1))
        (out / "campaign.md").write_text(summarise(state))
    (out / "campaign.md").write_text(summarise(state))
    print((out / "campaign.md").read_text() + f"every trial: {results}")
    return 0 if all(r["intact"] and r["bit_exact"] for r in state["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
