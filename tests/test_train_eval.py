"""train.py and eval.py end to end on tiny configs: runs, checkpoints, exact resume, torchrun, bad input."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vitpe import evaluation, training, viz
from vitpe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from vitpe.cli import eval as eval_cmd
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError, load_config
from vitpe.runs import RunError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def train(tmp_path, name, *extra):
    return train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", name, *extra])


def weights(run):
    return load_checkpoint(run)["model"]


def assert_same_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert train_cmd.main(["--config", TINY, "--out-dir", str(out), "--name", "base"]) == 0
    return out / "base"


def test_a_run_writes_config_checkpoint_and_metrics(tiny_run):
    assert (tiny_run / "config.yaml").is_file()
    rows = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(0 <= r["test_top1"] <= 1 and r["images_per_s"] > 0 for r in rows)
    assert list(csv.DictReader(open(tiny_run / "metrics.csv")))[-1]["epoch"] == "2"
    state = load_checkpoint(tiny_run)
    assert state["epoch"] == 2 and state["step"] == 0 and state["config"]["model"]["img_size"] == 16
    for key in ("optimizer", "scheduler", "scaler", "model_args", "data"):
        assert key in state


def test_a_new_run_never_overwrites_an_existing_one(tiny_run):
    before = (tiny_run / "checkpoint.pt").read_bytes()
    with pytest.raises(RunError, match="already exists; continue it with --resume"):
        train(tiny_run.parent, "base")
    assert (tiny_run / "checkpoint.pt").read_bytes() == before


def signal_after_update(sig, at_update):
    """Deliver ``sig`` to this process the instant after optimizer update number ``at_update`` (1-based): the
    worst moment, when the weights have moved but the step counter has not."""
    import signal as signal_module

    calls = {"n": 0}

    def hook(optimizer, args, kwargs):
        calls["n"] += 1
        if calls["n"] == at_update:
            os.kill(os.getpid(), getattr(signal_module, sig))

    from torch.optim.optimizer import register_optimizer_step_post_hook

    return register_optimizer_step_post_hook(hook)


@pytest.mark.parametrize("sig, at_update", [("SIGINT", 3), ("SIGTERM", 3), ("SIGINT", 8), ("SIGTERM", 13)])
def test_a_signal_right_after_an_update_resumes_bit_exactly(tiny_run, tmp_path, monkeypatch, sig, at_update):
    import signal as signal_module

    handle = signal_after_update(sig, at_update)
    try:
        assert train(tmp_path, "cut") == 128 + getattr(signal_module, sig)  # saved at the step boundary, then exit
    finally:
        handle.remove()
    state = load_checkpoint(tmp_path / "cut")
    assert (state["epoch"], state["step"]) == divmod(at_update, 8)  # tiny: 8 steps per epoch; the update is in
    assert signal_module.getsignal(signal_module.SIGINT) is signal_module.default_int_handler  # handlers restored
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    assert_same_weights(weights(tmp_path / "cut"), weights(tiny_run))
    rows = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    base = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    # wall_s is the run's training time across the stop: at least every epoch's own time, never restarting from zero
    assert rows[0]["wall_s"] >= rows[0]["epoch_s"] and rows[1]["wall_s"] >= rows[0]["wall_s"] + rows[1]["epoch_s"]
    for r, b in zip(rows, base):  # the interrupted epoch's metrics cover all its steps, not those after the resume
        assert r["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6) and r["train_acc"] == b["train_acc"]
        assert r["test_top1"] == b["test_top1"]


def test_resume_refuses_new_settings(tiny_run):
    with pytest.raises(ConfigError, match="continues with its saved config"):
        train_cmd.main(["--resume", str(tiny_run), "--set", "train.lr=0.1"])


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"model": {"w": torch.ones(2)}, "model_args": {}, "config": {}}, path)

    def dies_mid_write(obj, f, *a, **k):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {"w": torch.zeros(2)}, "model_args": {}, "config": {}}, path)
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left behind


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    calls = {"n": 0}
    real_ce = torch.nn.CrossEntropyLoss

    class NanAfterFirstEpoch(real_ce):
        def forward(self, logits, target):
            calls["n"] += 1
            loss = super().forward(logits, target)
            return loss * float("nan") if calls["n"] > 8 else loss  # tiny: 8 steps per epoch

    monkeypatch.setattr(training.torch.nn, "CrossEntropyLoss", NanAfterFirstEpoch)
    with pytest.raises(training.TrainingError, match=r"loss became nan at epoch 2 .* the last good checkpoint \(after epoch 1\) is kept"):
        train(tmp_path, "nan")
    assert load_checkpoint(tmp_path / "nan")["epoch"] == 1


def test_config_errors_are_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key model\.depht \(did you mean 'depth'\?\); valid keys: .*model\.depth"):
        train(tmp_path, "x", "--set", "model.depht=3")
    with pytest.raises(ConfigError, match=r"unknown config key modle \(did you mean 'model'\?\)"):
        train(tmp_path, "x", "--set", "modle.depth=3")
    with pytest.raises(ValueError, match=r"unknown positional encoding 'rope_mixd' \(did you mean 'rope_mixed'\?\)"):
        train(tmp_path, "x", "--set", "model.pos_embed=rope_mixd")
    with pytest.raises(ConfigError, match=r"train\.epochs must be int, got 'many'"):
        train(tmp_path, "x", "--set", "train.epochs=many")
    with pytest.raises(ConfigError, match=r"data\.augment='crop_flp' is not valid \(did you mean 'crop_flip'\?\)"):
        train(tmp_path, "x", "--set", "data.augment=crop_flp")
    with pytest.raises(ConfigError, match=r"data\.augment='sometimes' is not valid"):
        train(tmp_path, "x", "--set", "data.augment=sometimes")
    with pytest.raises(ConfigError, match="must be even"):
        train(tmp_path, "x", "--set", "data.mixup=0.8", "--set", "train.batch_size=31")
    with pytest.raises(ConfigError, match="config file nope.yaml not found"):
        train_cmd.main(["--config", "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  colour: red\n")
    with pytest.raises(ConfigError, match=r"unknown config key model\.colour; valid keys"):  # nothing near it: no guess
        train_cmd.main(["--config", str(bad)])
    with pytest.raises(ConfigError, match=r"unknown config key model\.colour"):
        train_cmd.main(["--config", str(bad)])
    assert not (tmp_path / "x").exists()


def test_pos_embed_options_from_the_command_line(tmp_path):
    assert train(tmp_path, "rope", "--pe", "sincos2d+rope_mixed", "--set", "model.pos_embed_kwargs.theta=5", "--epochs", "1") == 0
    state = load_checkpoint(tmp_path / "rope")
    assert state["model_args"]["pos_embed_kwargs"] == {"theta": 5}
    with pytest.raises(ValueError, match="unknown option 'nope'"):
        train(tmp_path, "rope2", "--set", "model.pos_embed_kwargs.nope=1")


def test_cli_prints_one_line_and_exits_non_zero(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--data", "mnist3d", "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().startswith("error: unknown dataset 'mnist3d'; choose one of shapes, gratings, fashion_mnist")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- eval.py -------------------------------------------------------------------------------------
def test_eval_table_json_csv_and_plot(tiny_run, tmp_path, capsys):
    out = tmp_path / "ev"
    assert eval_cmd.main([str(tiny_run), "--resolutions", "8", "16", "32", "16x24", "--coord-mode", "both", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 8 and {r["coord_mode"] for r in rows} == {"interpolate", "extrapolate"}
    assert all(0 <= r["top1"] <= r["top5"] <= 1 and r["n"] == 64 for r in rows)
    at_ref = [r for r in rows if r["resolution"] == "16"]
    assert at_ref[0]["top1"] == at_ref[1]["top1"]  # both modes give the integer grid at the training size
    assert len(list(csv.DictReader(open(out / "results.csv")))) == 8
    png = (out / "accuracy_vs_resolution.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    printed = capsys.readouterr().out
    assert "16x24" in printed and "sincos2d (interpolate)" in printed
    assert "sincos2d (extrapolate) @ 16x24: top-1" in printed  # not a terminal: a line per result as it comes
    # Beside accuracy: tokens, speed and each layer's attention (the default 64 test images) at every size.
    assert [r["tokens_per_image"] for r in rows[:4]] == [4, 16, 64, 24] and all(r["images_per_s"] > 0 for r in rows)
    for r in rows:
        assert len(r["attn_distance"]) == len(r["attn_entropy_norm"]) == 2  # tiny: 2 blocks
        assert all(0 < e <= 1 + 1e-4 for e in r["attn_entropy_norm"]) and all(d > 0 for d in r["attn_distance"])
    png = (out / "attention_vs_resolution.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    summary = json.loads((out / "summary.json").read_text())
    assert [s["label"] for s in summary] == ["sincos2d (interpolate)", "sincos2d (extrapolate)"]
    for s in summary:
        mine = {r["resolution"]: r["top1"] for r in rows if r["label"] == s["label"]}
        assert s["best_top1"] == max(mine[k] for k in ("8", "16", "32")) == mine[s["best_resolution"]]  # squares only
        assert s["top1_at_train_size"] == mine["16"] and (s["from_resolution"], s["to_resolution"]) == ("8", "32")
    assert "best" in printed and "mean top-1 over the log scale 8-32" in printed and "entropy/log(keys)" in printed
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 2


def test_sweep_summary_peak_and_area_over_the_log_scale():
    row = lambda size, top1: {"label": "a", "run": "r", "data": "d", "route": "coords", "train_size": 16, "height": size,  # noqa: E731
                              "width": size, "resolution": str(size), "top1": top1}
    rows = [row(8, 0.2), row(16, 0.8), row(32, 0.4), {**row(16, 0.9), "width": 32, "resolution": "16x32"}]
    (s,) = evaluation.sweep_summary(rows)
    # log2 scales -1, 0, 1: trapezoids (0.2 + 0.8) / 2 + (0.8 + 0.4) / 2 over a span of 2; the non-square size is not a peak
    assert s["auc_log_scale"] == pytest.approx(0.55) and (s["best_resolution"], s["best_top1"]) == ("16", 0.8)
    assert evaluation.sweep_summary([row(16, 0.7)])[0]["auc_log_scale"] == 0.7
    assert evaluation.default_resolutions(28, 4) == [(16, 16), (20, 20), (28, 28), (40, 40), (56, 56), (20, 40), (40, 20)]


def test_rows_and_plots_say_the_sizes_a_run_trained_at(tmp_path):
    """A run trained at several sizes (the main job: 16-48 px) is not 'trained at 32': its rows carry the range and the
    plot shades it; a run trained at one size has none."""
    root = Path(__file__).resolve().parents[1] / "configs"
    assert evaluation.trained_span(load_config(str(root / "shapes.yaml"))) == "16-48"
    assert evaluation.trained_span(load_config(str(root / "tiny.yaml"))) is None
    row = lambda size, top1, span: {"label": span or "one", "run": "r", "data": "d", "route": "coords", "train_size": 32,  # noqa: E731
                                    "train_sizes": span, "height": size, "width": size, "resolution": str(size), "top1": top1}
    rows = [row(s, t, span) for span in ("16-48", None) for s, t in ((16, 0.7), (32, 0.9), (64, 0.8))]
    viz.plot_accuracy(rows, tmp_path / "a.png", "t")
    viz.plot_accuracy([{k: v for k, v in r.items() if k != "train_sizes"} for r in rows], tmp_path / "b.png", "t")  # older rows
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "b.png").stat().st_size > 5000


def test_eval_default_sizes_include_aspect_ratios_and_diagnostics_can_be_off(tiny_run, tmp_path):
    assert eval_cmd.main([str(tiny_run), "--diagnostics", "0", "--test-size", "16", "--out", str(tmp_path / "e")]) == 0
    rows = json.loads((tmp_path / "e" / "results.json").read_text())
    assert [r["resolution"] for r in rows] == ["8", "12", "16", "24", "32", "12x24", "24x12"]
    assert not any("attn_distance" in r for r in rows) and not (tmp_path / "e" / "attention_vs_resolution.png").exists()
    # The patch route takes the default sizes that keep the trained 4x4 grid, and refuses a given one that does not.
    assert eval_cmd.main([str(tiny_run), "--route", "patch", "--diagnostics", "0", "--test-size", "16", "--out", str(tmp_path / "p")]) == 0
    assert [r["resolution"] for r in json.loads((tmp_path / "p" / "results.json").read_text())] == ["8", "12", "16", "24", "32"]
    with pytest.raises(SystemExit):
        eval_cmd.main([str(tiny_run), "--diagnostics", "-1"])


def test_eval_top1_matches_training_metrics_at_the_training_resolution(tiny_run, tmp_path):
    assert eval_cmd.main([str(tiny_run), "--resolutions", "16", "--out", str(tmp_path / "e")]) == 0
    rows = json.loads((tmp_path / "e" / "results.json").read_text())
    last = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()][-1]
    # Other batch sizes sum in another order: the loss agrees to rounding, top-1 at most by one borderline image.
    assert abs(rows[0]["top1"] - last["test_top1"]) <= 1 / rows[0]["n"] + 1e-9
    assert rows[0]["loss"] == pytest.approx(last["test_loss"], rel=1e-4)


def test_eval_compares_several_runs_on_one_table(tiny_run, tmp_path):
    assert train(tmp_path, "rope", "--pe", "rope_axial", "--epochs", "1") == 0
    out = tmp_path / "cmp"
    assert eval_cmd.main([str(tiny_run), str(tmp_path / "rope"), "--resolutions", "16", "32", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert sorted({r["label"] for r in rows}) == ["rope_axial", "sincos2d"]
    # Each run is measured on its own test subset, not on the first run's.
    assert train(tmp_path, "small", "--epochs", "1", "--set", "data.test_size=32") == 0
    both = tmp_path / "both"
    assert eval_cmd.main([str(tiny_run), str(tmp_path / "small"), "--resolutions", "16", "--out", str(both)]) == 0
    assert [r["n"] for r in json.loads((both / "results.json").read_text())] == [64, 32]


def test_eval_bad_inputs(tiny_run, tmp_path):
    with pytest.raises(ConfigError, match="resolution 18x18 is not a multiple of the patch size 4"):
        eval_cmd.main([str(tiny_run), "--resolutions", "18", "--out", str(tmp_path / "a")])
    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes((tiny_run / "checkpoint.pt").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="is truncated or corrupt"):
        eval_cmd.main([str(truncated)])
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, foreign)
    with pytest.raises(CheckpointError, match="is not a vitpe checkpoint"):
        eval_cmd.main([str(foreign)])
    state = load_checkpoint(tiny_run)
    state["model"]["head.weight"] = torch.zeros(3, 32)
    mismatched = tmp_path / "mismatch.pt"
    save_checkpoint({k: v for k, v in state.items() if k != "format"}, mismatched)
    with pytest.raises(CheckpointError, match=r"does not fit this model: 1 with other shapes \(e\.g\. head\.weight \(3, 32\) vs \(10, 32\)\)"):
        eval_cmd.main([str(mismatched)])
    with pytest.raises(CheckpointError, match="does not exist"):
        eval_cmd.main([str(tmp_path / "missing.pt")])
    with pytest.raises(CheckpointError, match="no checkpoint.pt in run directory"):
        eval_cmd.main([str(tmp_path)])


# ---- torchrun --------------------------------------------------------------------------------------
def test_torchrun_two_cpu_processes_match_one_process(tiny_run, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517", "train.py",
           "--config", TINY, "--set", "train.device=cpu", "--out-dir", str(tmp_path), "--name", "ddp"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout
    assert_same_weights(weights(tmp_path / "ddp"), weights(tiny_run), exact=False)


def test_full_recipe_mixup_cutmix_ema_trivialaugment(tmp_path):
    rc = train(tmp_path, "recipe", "--epochs", "1", "--set", "data.mixup=0.8", "--set", "data.cutmix=1.0", "--set", "data.augment=trivial",
               "--set", "train.ema_decay=0.9", "--set", "model.drop_path_rate=0.1", "--set", "train.amp=bf16")
    assert rc == 0
    state = load_checkpoint(tmp_path / "recipe")
    assert state["ema"] is not None and state["ema"].keys() == state["model"].keys()
    assert any(not torch.equal(state["ema"][k], state["model"][k]) for k in state["model"])  # EMA trails the weights
    assert eval_cmd.main([str(tmp_path / "recipe"), "--resolutions", "16", "--out", str(tmp_path / "e")]) == 0


def test_token_dropping_and_packed_mixed_size_training_run_and_resume(tmp_path):
    assert train(tmp_path, "drop", "--set", "train.token_keep=0.5", "--pe", "learned+peg") == 0
    rows = [json.loads(line) for line in (tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 <= r["test_top1"] <= 1 for r in rows)
    mixed = ["--set", "train.max_tokens=48", "--set", "train.resolution_range=[8, 24]", "--set", "train.token_keep=0.75",
             "--set", "model.coord_aug={shift: 0.5}", "--pe", "rope_mixed+rel_bias"]
    assert train(tmp_path, "pack", *mixed) == 0
    # Interrupted after update 5 and resumed: the same weights as the uninterrupted run (sizes, drops, packing repeat).
    import signal as signal_module

    handle = signal_after_update("SIGINT", 5)
    try:
        assert train(tmp_path, "cut", *mixed) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    assert_same_weights(weights(tmp_path / "cut"), weights(tmp_path / "pack"))
    cfg = load_checkpoint(tmp_path / "pack")["config"]
    assert cfg["train"]["max_tokens"] == 48 and cfg["train"]["token_keep"] == 0.75


def test_packed_training_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_tokens=20 is smaller than one image: the largest training size 24x24 has 36 patch tokens"):
        train(tmp_path, "x", "--set", "train.max_tokens=20", "--set", "train.resolution_range=[8, 24]")
    with pytest.raises(ConfigError, match=r"train.token_keep=0.0 is out of range"):
        train(tmp_path, "x", "--set", "train.token_keep=0")
    with pytest.raises(ConfigError, match="mixup/cutmix blend images of one size"):
        train(tmp_path, "x", "--set", "train.max_tokens=64", "--set", "data.mixup=0.8")


def test_eval_at_native_aspect_ratio(tiny_run, tmp_path, capsys):
    assert eval_cmd.main([str(tiny_run), "--resolutions", "16", "--native", "--out", str(tmp_path / "e")]) == 0
    rows = json.loads((tmp_path / "e" / "results.json").read_text())
    native = [r for r in rows if r["resolution"] == "native"]
    fixed = [r for r in rows if r["resolution"] == "16"]
    assert len(native) == 1 and native[0]["tokens_per_image"] == 16 == fixed[0]["tokens_per_image"]
    # shapes is square: its native aspect ratio at the training area is the training size, packed or not
    assert abs(native[0]["top1"] - fixed[0]["top1"]) <= 1.5 / fixed[0]["n"]
    assert "native" in capsys.readouterr().out


@pytest.mark.parametrize("pe,controls,error", [
    ("sincos2d+liere", ["--rope-scaling", "pi"], None),
    ("fourier+string", ["--rope-scaling", "yarn", "--p-rope", "0.25"], None),
    ("learned+fire", ["--rope-scaling", "yarn"], r"no positional encoding of this model \(learned\+fire\) takes the test-time option 'scaling'"),
    ("sincos2d+comrope", ["--rope-scaling", "ntk"], "no frequency table"),
    ("lookhere", ["--lookhere-slope", "2"], None),
    ("sincos2d", ["--lookhere-slope", "2"], r"no positional encoding of this model \(sincos2d\) takes the test-time option 'lookhere.slope'"),
    ("learned+lookhere", ["--pe-option", "slope=3"], None),
    ("rope_axial", ["--pe-option", "rope_axial.yarn_beta=16", "--pe-option", "scaling=yarn"], None),
    ("rope_axial", ["--pe-option", "slope=3"], "takes the test-time option 'slope'.*its options: rope_axial.scaling, rope_axial.p_rope"),
    ("rope_axial", ["--pe-option", "yarn_beta=nan"], "yarn_beta='nan'.*finite"),  # once NaN logits scored as 9% top-1
])
def test_new_families_train_and_evaluate_with_their_test_time_controls(tmp_path, pe, controls, error):
    assert train(tmp_path, "run", "--set", f"model.pos_embed={pe}", "--set", "train.epochs=1") == 0
    args = [str(tmp_path / "run"), "--resolutions", "16", "32", "--coord-mode", "extrapolate", *controls, "--out", str(tmp_path / "ev")]
    if error:
        with pytest.raises(ConfigError, match=error):
            eval_cmd.main(args)
        return
    assert eval_cmd.main(args) == 0
    rows = json.loads((tmp_path / "ev" / "results.json").read_text())
    if controls[0] == "--rope-scaling":
        assert rows[0]["rope_scaling"] == controls[1] and f"[scaling {controls[1]}]" in rows[0]["label"]  # a declared option like any other
        assert rows[0]["p_rope"] == (controls[3] if "--p-rope" in controls else None)
    else:  # a family's declared option, by --pe-option or its own old flag: one column, and in the label
        given = ";".join(c if "=" in c else f"lookhere.slope={c}" for c in controls[1::2])
        assert rows[0]["pe_options"] == given and all(f"[{item.replace('=', ' ')}]" in rows[0]["label"] for item in given.split(";"))
    assert len(rows) == 2
    assert all(0 <= r["top1"] <= 1 for r in rows)


def test_eval_refuses_a_lookhere_slope_that_is_not_positive():
    for bad in ("0", "-1", "inf", "steep"):
        with pytest.raises(SystemExit):
            eval_cmd.parse_args(["runs/A", "--lookhere-slope", bad])
        with pytest.raises(ConfigError, match=f"'{bad}' is not a valid slope"):
            eval_cmd.parse_pe_options([f"lookhere.slope={bad}"])
    for bad, why in (("lookhere.slope", "must look like FAMILY.OPTION=VALUE"), ("lookhere.slop=2", "no registered family declares it"),
                     ("=2", "must look like")):
        with pytest.raises(ConfigError, match=why):
            eval_cmd.parse_pe_options([bad])
    assert eval_cmd.parse_pe_options(["slope=2", "rope_mixed.p_rope=0.25"]) == [("slope", "2"), ("rope_mixed.p_rope", "0.25")]


class EveryStep(training.Heartbeat):
    """A log line at every tick (the real one waits a minute)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "every": 0.0})


class FixedRate(training.RateProbe):
    """The probe's window as in a real run, with a known rate at its end."""

    def tick(self):
        return None if super().tick() is None else 128.0


def test_a_time_budget_sets_the_epochs_from_the_measured_rate_and_resumes_with_them(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(training, "RateProbe", FixedRate)
    monkeypatch.setattr(training, "Heartbeat", EveryStep)
    # tiny: 8 steps x 32 images per epoch; 0.1 min at 128 img/s is 768 images, 3 epochs
    assert train(tmp_path, "b", "--set", "train.budget_min=0.1") == 0
    lines = capsys.readouterr().out
    assert "epoch 1/3 step: 8/8" in lines and "epoch 1/2 step" not in lines  # the log's label follows the decision
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["lr"] == pytest.approx(1e-5)  # the cosine was stretched to end with the budget's last step
    assert load_config(str(tmp_path / "b" / "config.yaml")).train.epochs == 3  # the decision is on record
    state = load_checkpoint(tmp_path / "b")
    assert state["budget"] == {"images_per_s": 128.0, "epochs": 3} and state["config"]["train"]["epochs"] == 3
    # Cut in epoch 2 and resumed: no second measurement, the same weights as the uninterrupted run.
    import signal as signal_module

    handle = signal_after_update("SIGINT", 12)
    try:
        assert train(tmp_path, "cut", "--set", "train.budget_min=0.1") == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    monkeypatch.setattr(training, "RateProbe", None)  # a resumed run that measured again would fail here
    assert train_cmd.main(["--resume", str(tmp_path / "cut")]) == 0
    assert_same_weights(weights(tmp_path / "cut"), weights(tmp_path / "b"))


def test_a_time_budget_with_the_real_clock_records_a_consistent_plan(tmp_path, capsys):
    with pytest.raises(ConfigError, match="train.epochs was given but train.budget_min=0.01 decides the epochs"):
        train(tmp_path, "x", "--set", "train.budget_min=0.01", "--epochs", "5")
    assert train(tmp_path, "b", "--set", "train.budget_min=0.01") == 0
    state = load_checkpoint(tmp_path / "b")
    plan = state["budget"]
    assert plan["images_per_s"] > 0 and plan["epochs"] == max(1, int(0.6 * plan["images_per_s"] // 256)) == state["epoch"]
    assert "img/s measured over this run's first steps" in capsys.readouterr().out


def test_test_time_augmentation_after_the_last_epoch_and_in_eval(tmp_path, capsys):
    with pytest.raises(ConfigError, match="shapes's labels change under a mirror image, so train.eval_tta=flip would mix classes"):
        train(tmp_path, "x", "--set", "train.eval_tta=flip")
    with pytest.raises(ConfigError, match="so data.augment=flip would do nothing"):
        train(tmp_path, "x", "--set", "data.augment=flip")
    with pytest.raises(ConfigError, match=r"train.eval_tta='mirror' is not valid"):
        train(tmp_path, "x", "--set", "train.eval_tta=mirror")
    assert train(tmp_path, "t", "--set", "train.eval_tta=shift") == 0
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert "test_top1_tta_shift" not in rows[0] and 0 <= rows[-1]["test_top1_tta_shift"] <= 1  # the last epoch only
    assert f"({rows[-1]['test_top1_tta_shift']:.4f} with test-time augmentation shift)" in capsys.readouterr().out
    assert eval_cmd.main([str(tmp_path / "t"), "--resolutions", "16", "--tta", "shift", "--out", str(tmp_path / "e")]) == 0
    row = json.loads((tmp_path / "e" / "results.json").read_text())[0]
    assert row["tta"] == "shift" and row["top1"] == pytest.approx(rows[-1]["test_top1_tta_shift"])
    with pytest.raises(ConfigError, match="use --tta shift"):
        eval_cmd.main([str(tmp_path / "t"), "--tta", "flip", "--out", str(tmp_path / "e2")])


def test_content_keep_trains_evaluates_and_predicts(tmp_path, capsys):
    assert train(tmp_path, "ck", "--set", "model.content_keep=0.5", "--set", "train.token_keep=0.75") == 0
    assert load_checkpoint(tmp_path / "ck")["model_args"]["content_keep"] == 0.5
    assert eval_cmd.main([str(tmp_path / "ck"), "--resolutions", "16", "24", "--out", str(tmp_path / "e")]) == 0
    rows = json.loads((tmp_path / "e" / "results.json").read_text())
    assert [r["resolution"] for r in rows] == ["16", "24"] and all(0 <= r["top1"] <= 1 for r in rows)
    with pytest.raises(ConfigError, match="evaluate it without --native"):
        eval_cmd.main([str(tmp_path / "ck"), "--native", "--out", str(tmp_path / "e2")])
    with pytest.raises(ConfigError, match="model.content_keep=0.5 selects tokens from whole images"):
        train(tmp_path, "x", "--set", "model.content_keep=0.5", "--set", "train.max_tokens=64")


def test_tensorboard_curves_are_written_beside_the_metrics_and_once_per_epoch_after_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    import signal as signal_module

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    handle = signal_after_update("SIGTERM", 12)  # tiny: 8 steps an epoch; stopped inside epoch 2, after epoch 1's events
    try:
        assert train(tmp_path, "tb", "--set", "train.tensorboard=true") == 128 + signal_module.SIGTERM
    finally:
        handle.remove()
    run = tmp_path / "tb"
    assert train_cmd.main(["--resume", str(run)]) == 0
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "test/loss", "test/top1", "train/lr", "speed/images_per_s"} <= tags
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    top1 = acc.Scalars("test/top1")
    assert [e.step for e in top1] == [r["epoch"] for r in rows]
    assert top1[-1].value == pytest.approx(rows[-1]["test_top1"], rel=1e-6)


def test_tensorboard_asked_for_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    from vitpe.config import apply_overrides

    with pytest.raises(ConfigError, match=r"train.tensorboard=true needs the tensorboard package.*pip install tensorboard"):
        apply_overrides(load_config(TINY), ["train.tensorboard=true"])
