"""Time-to-accuracy levers: a schedule of training sizes (small first, the target size last) and amp=auto measured on
a CPU, each recorded so that a run resumes as it began."""
import json
import signal as signal_module
import time
from pathlib import Path

import pytest
import torch

from vitpe import engine, training
from vitpe.checkpoint import load_checkpoint
from vitpe.cli import eval as eval_cmd
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError, apply_overrides, load_config, resolution_stages, schedule_text, sizes_at, train_resolutions

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SCHEDULE = "train.resolution_schedule=[[0, 8, 12], [0.5, 16]]"


def tiny(*overrides):
    return apply_overrides(load_config(TINY), list(overrides))


def test_a_schedule_gives_each_stage_its_epochs_and_says_so():
    cfg = tiny("train.epochs=10", "train.resolution_schedule=[[0, 16, 24], [0.6, 28], [0.9, 32]]")
    assert resolution_stages(cfg) == [(0, [16, 20, 24]), (6, [28]), (9, [32])]
    assert [sizes_at(cfg, e) for e in (0, 5, 6, 8, 9)] == [[16, 20, 24], [16, 20, 24], [28], [28], [32]]
    assert schedule_text(cfg) == "16-24 px in epochs 1-6, 28 in epochs 7-9, 32 in epoch 10"
    assert train_resolutions(cfg) == [16, 20, 24, 28, 32]  # what memory is planned for and shapes is rendered at
    short = tiny("train.epochs=2", "train.resolution_schedule=[[0, 8], [0.2, 12], [0.6, 16]]")
    assert resolution_stages(short) == [(0, [12]), (1, [16])]  # the first stage rounds to no epoch: the next takes epoch 1
    assert schedule_text(tiny()) is None and resolution_stages(tiny()) == [(0, [16])]


@pytest.mark.parametrize("schedule, message", [
    ("[[0.1, 16], [0.5, 24]]", r"begin at fractions of the run that rise from 0 and stay below 1, got \[0.1, 0.5\]"),
    ("[[0, 16], [0.5, 12], [0.5, 24]]", "rise from 0"),
    ("[[0, 16], [1.0, 24]]", "stay below 1"),
    ("[[0, 16, 20, 24]]", r"must be \[from, size\] or \[from, lo, hi\]"),
    ("[[0, 17.5]]", "whole sizes"),
    ("[[0, 5, 7]]", "holds no multiple of model.patch_size=4"),
    ("[]", "at least one stage"),
])
def test_a_malformed_schedule_is_refused_in_one_line(schedule, message):
    with pytest.raises(ConfigError, match=message):
        tiny(f"train.resolution_schedule={schedule}")


def test_a_schedule_takes_the_place_of_the_other_size_keys_and_of_a_budget():
    with pytest.raises(ConfigError, match="set one of train.resolution_range and train.resolution_schedule"):
        tiny("train.resolution_range=[8, 16]", SCHEDULE)
    with pytest.raises(ConfigError, match="give train.epochs with a schedule"):
        tiny(SCHEDULE, "train.budget_min=1")


def test_a_scheduled_run_trains_each_stage_records_it_and_resumes_bit_exactly(tmp_path, monkeypatch, capsys):
    from test_train_eval import assert_same_weights, signal_after_update

    seen = []
    real = training.Job.update

    def update(job, net, x, target, progress):  # the size each step trains at, by epoch
        seen.append((job.epoch, x.shape[-1]))
        return real(job, net, x, target, progress)

    monkeypatch.setattr(training.Job, "update", update)
    args = ["--config", TINY, "--out-dir", str(tmp_path), "--epochs", "3", "--set", SCHEDULE, "--set", "train.amp=none"]
    assert train_cmd.main([*args, "--name", "full"]) == 0
    assert "sizes 8-12 px in epochs 1-2, 16 in epoch 3" in capsys.readouterr().out
    assert {s for e, s in seen if e < 2} == {8, 12} and {s for e, s in seen if e == 2} == {16} and len(seen) == 24
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_sizes"] for r in rows] == ["8-12", "8-12", "16"]
    # interrupted inside the second stage (tiny: 8 steps an epoch) and resumed: the weights of the uninterrupted run
    handle = signal_after_update("SIGINT", 19)
    try:
        assert train_cmd.main([*args, "--name", "cut"]) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    state = load_checkpoint(tmp_path / "cut")
    assert (state["epoch"], state["step"]) == (2, 3)
    seen.clear()
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    assert seen == [(2, 16)] * 5  # the rest of the last stage's epoch, at its size
    assert_same_weights(load_checkpoint(tmp_path / "cut")["model"], load_checkpoint(tmp_path / "full")["model"])
    assert eval_cmd.main([str(tmp_path / "full"), "--resolutions", "16", "--diagnostics", "0", "--out", str(tmp_path / "ev")]) == 0
    row = json.loads((tmp_path / "ev" / "results.json").read_text())[0]
    assert row["train_schedule"] == "8-12 px in epochs 1-2, 16 in epoch 3" and row["train_sizes"] == "8-16"


def test_amp_auto_on_a_cpu_measures_and_takes_the_faster_only_when_it_wins_clearly(monkeypatch):
    calls = []

    def step(seconds):
        def run(dtype):
            calls.append(dtype)
            time.sleep(seconds[dtype])
        return run

    monkeypatch.setattr(engine, "cpu_bf16_units", lambda: "")
    dtype, line = engine.pick_cpu_amp(step({None: 0.0, torch.bfloat16: 0.0}))
    assert dtype is None and calls == [] and "no bf16 units" in line  # emulated bf16 is never measured
    monkeypatch.setattr(engine, "cpu_bf16_units", lambda: "amx_bf16")
    dtype, line = engine.pick_cpu_amp(step({None: 0.02, torch.bfloat16: 0.01}))
    assert dtype is torch.bfloat16 and calls == [None, torch.bfloat16] * 4 and "amx_bf16" in line and ": bf16" in line
    dtype, line = engine.pick_cpu_amp(step({None: 0.02, torch.bfloat16: 0.019}))
    assert dtype is None and ": fp32" in line  # 1.05x is within what two runs differ by: not worth a change of numerics


def test_a_run_says_and_records_what_amp_auto_chose_and_a_resume_keeps_it(tmp_path, monkeypatch, capsys):
    probes = []

    def faster_bf16(step, rounds=3, margin=0.9):
        step(None), step(torch.bfloat16)  # the probe runs real steps of this model, and changes no weight
        probes.append(1)
        return torch.bfloat16, "amp=auto: bf16 autocast ran a step at 1.50x the speed of fp32 (test): bf16"

    monkeypatch.setattr(training, "pick_cpu_amp", faster_bf16)
    base = ["--config", TINY, "--out-dir", str(tmp_path), "--set", "train.device=cpu"]
    from test_train_eval import signal_after_update

    handle = signal_after_update("SIGINT", 3)
    try:
        assert train_cmd.main([*base, "--name", "a"]) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    out = capsys.readouterr().out
    assert "amp=auto: bf16 autocast ran a step at 1.50x" in out and "amp=torch.bfloat16" in out
    assert load_checkpoint(tmp_path / "a")["amp"] == "bf16" and probes == [1]
    monkeypatch.setattr(training, "pick_cpu_amp", lambda *a, **k: pytest.fail("a resumed run measured again"))
    assert train_cmd.main(["--resume", str(tmp_path / "a")]) == 0
    assert "amp=torch.bfloat16" in capsys.readouterr().out and load_checkpoint(tmp_path / "a")["amp"] == "bf16"
    assert train_cmd.main([*base, "--name", "b", "--set", "train.amp=none"]) == 0  # forced: no probe
    assert load_checkpoint(tmp_path / "b")["amp"] == "none"
