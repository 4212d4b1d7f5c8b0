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
from vitpe.config import (
    ConfigError,
    apply_overrides,
    batch_at,
    budget_epochs,
    load_config,
    resolution_stages,
    schedule_text,
    sizes_at,
    step_cost,
    train_resolutions,
)

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


def test_a_schedule_takes_the_place_of_the_other_size_keys():
    with pytest.raises(ConfigError, match="set one of train.resolution_range and train.resolution_schedule"):
        tiny("train.resolution_range=[8, 16]", SCHEDULE)


def test_a_budget_over_a_schedule_counts_each_stage_at_its_own_cost():
    cfg = tiny(SCHEDULE.replace("8, 12", "8"))  # 8 px, then 16: width 32, mlp_ratio 2
    assert step_cost(cfg, 8) == 8 * 32 * 4 + 2 * 4**2 and step_cost(cfg, 16) == 8 * 32 * 16 + 2 * 16**2
    slower = step_cost(cfg, 16) / step_cost(cfg, 8)
    # 10 s an epoch at 8 px, slower x that at 16; the second half of the epochs at 16
    assert budget_epochs(cfg, 100.0, 1000, 2 * 10 + 1 * 10 * slower, [8]) == (3, pytest.approx(20 + 10 * slower))
    assert budget_epochs(cfg, 100.0, 1000, 2 * 10 + 2 * 10 * slower - 1, [8])[0] == 3  # 4 epochs would not fit
    plain = tiny()
    assert budget_epochs(plain, 100.0, 1000, 95.0, [16]) == (9, pytest.approx(90.0))  # one size: whole epochs at the rate
    assert budget_epochs(plain, 100.0, 1000, 5.0, [16])[0] == 1  # always one epoch
    # the rate measured over the first sizes of a range speaks for the range's mean cost
    ranged = tiny("train.resolution_range=[8, 16]")
    assert budget_epochs(ranged, 100.0, 1000, 95.0, [8, 12, 16])[0] == 9


def test_a_budgeted_run_over_a_schedule_fits_its_epochs_and_says_how(tmp_path, monkeypatch, capsys):
    from test_train_eval import EveryStep, FixedRate

    monkeypatch.setattr(training, "RateProbe", FixedRate)
    monkeypatch.setattr(training, "Heartbeat", EveryStep)
    # tiny: 8 steps x 32 images an epoch; 128 img/s at 8 px (2 s an epoch) and 16 px costs about 4.4x (8.7 s): in
    # 13.2 s, 3 epochs (2 + 2 + 8.7 s), where a rate taken for every size would have given 6
    args = ["--config", TINY, "--out-dir", str(tmp_path), "--name", "b", "--set", SCHEDULE.replace("8, 12", "8"),
            "--set", "train.budget_min=0.22", "--set", "train.amp=none"]
    assert train_cmd.main(args) == 0
    out = capsys.readouterr().out
    assert "128 img/s measured over this run's first steps at 8 px; the later sizes' rates scaled by their tokens' cost" in out
    epochs = load_checkpoint(tmp_path / "b")["config"]["train"]["epochs"]
    cfg = tiny(SCHEDULE.replace("8, 12", "8"))
    assert epochs == budget_epochs(cfg, 128.0, 256, 13.2, [8])[0] == 3
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train_sizes"] == "8" and rows[-1]["train_sizes"] == "16" and len(rows) == epochs


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
    assert dtype is torch.bfloat16 and calls == [None, torch.bfloat16] * 6 and "amx_bf16" in line and ": bf16" in line
    dtype, line = engine.pick_cpu_amp(step({None: 0.02, torch.bfloat16: 0.019}))
    assert dtype is None and ": fp32" in line  # 1.05x is within what two runs differ by: not worth a change of numerics
    lucky = iter([0.02, 0.02, 0.02, 0.02, 0.02, 0.005, 0.02, 0.019, 0.02, 0.019, 0.02, 0.019])  # one fast bf16 round

    def once(dtype):
        time.sleep(next(lucky))

    assert engine.pick_cpu_amp(once)[0] is None  # one lucky round does not decide


def test_a_run_says_and_records_what_amp_auto_chose_and_a_resume_keeps_it(tmp_path, monkeypatch, capsys):
    probes = []

    def faster_bf16(step, **kwargs):
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


def test_a_schedule_can_keep_its_tokens_per_step_and_resumes_bit_exactly(tmp_path, monkeypatch):
    from test_train_eval import assert_same_weights, signal_after_update

    two = "train.resolution_schedule=[[0, 8], [0.5, 16]]"
    cfg = tiny(two, "train.schedule_batch=tokens")
    assert [batch_at(cfg, e) for e in (0, 1)] == [128, 32]  # 8 px holds a quarter of 16 px's tokens: 4x the images
    assert batch_at(tiny(two, "train.schedule_batch=tokens", "data.mixup=0.2"), 0, world=3) == 126  # per process, even
    assert batch_at(tiny(two), 0) == 32  # the default keeps the images
    with pytest.raises(ConfigError, match="schedule_batch=tokens sizes each stage's batch of a train.resolution_schedule"):
        tiny("train.schedule_batch=tokens")
    with pytest.raises(ConfigError, match=r"train.schedule_batch='token' is not valid \(did you mean 'tokens'\?\)"):
        tiny(two, "train.schedule_batch=token")
    seen = []
    real = training.Job.update

    def update(job, net, x, target, progress):
        seen.append((job.epoch, x.shape[0], x.shape[-1]))
        return real(job, net, x, target, progress)

    monkeypatch.setattr(training.Job, "update", update)
    args = ["--config", TINY, "--out-dir", str(tmp_path), "--set", two, "--set", "train.schedule_batch=tokens", "--set", "train.amp=none"]
    assert train_cmd.main([*args, "--name", "full"]) == 0
    assert seen == [(0, 128, 8)] * 2 + [(1, 32, 16)] * 8  # tiny's 256 images: 2 steps, then 8
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["lr"] == pytest.approx(1e-5)  # the cosine spans the 10 steps there are, and ends with them
    handle = signal_after_update("SIGINT", 5)  # in the second epoch, whose steps are smaller
    try:
        assert train_cmd.main([*args, "--name", "cut"]) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    assert (load_checkpoint(tmp_path / "cut")["epoch"], load_checkpoint(tmp_path / "cut")["step"]) == (1, 3)
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    assert_same_weights(load_checkpoint(tmp_path / "cut")["model"], load_checkpoint(tmp_path / "full")["model"])
