"""Nothing lost: runs that stop at any moment resume, checkpoints are never non-finite or silently corrupt,
a run directory has one owner, and every bad value is one line (docs/reliability.md)."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from vitpe import evaluation, training
from vitpe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from vitpe.cli import eval as eval_cmd
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError
from vitpe.data import DataError, load_dataset
from vitpe.runs import RunError, RunLock, create_run_dir, remove_stale

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")  # 8 steps per epoch, 2 epochs


def train(out, name, *extra):
    return train_cmd.main(["--config", TINY, "--out-dir", str(out), "--name", name, *extra])


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel")
    assert train(out, "base") == 0
    return out / "base"


class Hooks:
    """Global optimizer hooks for one test: faults at exact updates (1-based counts)."""

    def __init__(self):
        self.handles, self.n = [], 0

    def at_update(self, k, pre=None, post=None):
        def pre_hook(opt, args, kwargs):
            self.n += 1
            if self.n == k and pre:
                pre(opt)

        def post_hook(opt, args, kwargs):
            if self.n == k and post:
                post(opt)

        self.handles += [register_optimizer_step_pre_hook(pre_hook), register_optimizer_step_post_hook(post_hook)]
        return self

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.fixture
def hooks():
    h = Hooks()
    yield h
    h.remove()


def inf_gradient(opt):
    p = opt.param_groups[0]["params"][0]
    p.grad.fill_(float("inf"))


# ---- 2. a run stopped before its first checkpoint ---------------------------------------------------------
def test_a_run_killed_before_its_first_checkpoint_resumes_from_its_config(base, tmp_path, monkeypatch):
    real = training.seed_step

    def dies(*parts):
        if parts[1:] == (0, 2):
            raise SystemExit("killed")  # as a kill -9 would leave it: config.yaml, no checkpoint
        real(*parts)

    monkeypatch.setattr(training, "seed_step", dies)
    with pytest.raises(SystemExit):
        train(tmp_path, "early")
    monkeypatch.undo()
    assert not (tmp_path / "early" / "checkpoint.pt").exists() and (tmp_path / "early" / "config.yaml").is_file()
    with pytest.raises(RunError, match="already exists; continue it with --resume"):
        train(tmp_path, "early")
    assert train_cmd.main(["--resume", str(tmp_path / "early")]) == 0
    assert same_weights(load_checkpoint(tmp_path / "early")["model"], load_checkpoint(base)["model"])


def test_a_kill_while_the_run_directory_is_made_leaves_no_run_without_its_config(base, tmp_path, monkeypatch):
    """The run directory appears under its name with config.yaml already in it (staged, then renamed): the kill
    -9 window between mkdir and config.yaml that a CI reliability campaign once hit is gone."""
    def killed(cfg, path):
        raise SystemExit("killed")  # inside the staging directory, before the rename

    monkeypatch.setattr(training, "save_config", killed)
    with pytest.raises(SystemExit):
        train(tmp_path, "mid")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # no run, and the staging directory cleaned up
    stale = tmp_path / ".mid.new999999999"  # what a kill -9 leaves: a staging directory of a process that is gone
    stale.mkdir()
    (stale / "config.yaml").write_text("model: {}\n")
    assert train(tmp_path, "mid") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid"]  # the stale staging removed
    # a live creation of the run "mid.new1" stages ".mid.new1.newPID": the glob for "mid"'s leftovers matches it, but
    # it is not "mid"'s and its process is alive, so removing "mid"'s leftovers must leave it
    other = tmp_path / f".mid.new1.new{os.getppid()}"
    other.mkdir()
    remove_stale(tmp_path, ".mid.new")
    assert other.is_dir()
    other.rmdir()
    assert same_weights(load_checkpoint(tmp_path / "mid")["model"], load_checkpoint(base)["model"])
    with pytest.raises(RunError, match="already exists; continue it with --resume"):
        create_run_dir(tmp_path, "mid", fill=lambda d: (d / "config.yaml").write_text("x"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid"]
    # a directory an older vitpe left empty (lock file only) is named as such, not reported as a missing checkpoint
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ".lock").write_text("1")
    with pytest.raises(RunError, match="is empty .*remove it and start the run again"):
        train_cmd.main(["--resume", str(tmp_path / "old")])


@pytest.mark.parametrize("extra, message", [
    (["--pe", "rope_mixd"], "did you mean 'rope_mixed'"),
    (["--set", "train.batch_size=1000"], "larger than the 256 training images"),
    (["--set", "model.pos_embed_kwargs={nope: 1}"], "unknown option .nope. for positional encoding .sincos2d."),
    (["--set", "data.name=imagefolder:/nonexistent"], "is not a directory"),
])
def test_late_config_errors_leave_no_run_directory(tmp_path, extra, message):
    with pytest.raises((ValueError, DataError), match=message):
        train(tmp_path, "x", *extra)
    assert not (tmp_path / "x").exists()


# ---- 3. SIGTERM under torchrun ---------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_under_torchrun_saves_and_says_how_to_resume(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py",
           "--config", TINY, "--set", "train.device=cpu", "--epochs", "200", "--out-dir", str(tmp_path), "--name", "ddp"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpt = tmp_path / "ddp" / "checkpoint.pt"
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # what a scheduler sends to torchrun, which passes it on to every rank
    out, _ = p.communicate(timeout=120)
    assert "SIGTERM at epoch" in out and f"--resume {tmp_path / 'ddp'}" in out, out[-3000:]
    state = load_checkpoint(tmp_path / "ddp")
    assert 0 < state["epoch"] * 8 + state["step"] < 200 * 8


# ---- 4. non-finite weights are never checkpointed ---------------------------------------------------------
def test_an_inf_gradient_in_the_first_epoch_writes_no_checkpoint(tmp_path, hooks):
    hooks.at_update(8, pre=inf_gradient)  # the epoch's last step: its loss was still finite
    with pytest.raises(training.TrainingError, match="no checkpoint was written yet; python train.py --resume"):
        train(tmp_path, "inf")
    assert not (tmp_path / "inf" / "checkpoint.pt").exists()


def test_an_inf_gradient_later_keeps_the_last_good_checkpoint_and_says_so(tmp_path, hooks):
    hooks.at_update(16, pre=inf_gradient)
    with pytest.raises(training.TrainingError, match=r"the last good checkpoint \(after epoch 1\) is kept"):
        train(tmp_path, "inf")
    state = load_checkpoint(tmp_path / "inf")
    assert state["epoch"] == 1 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_ctrl_c_after_a_bad_update_does_not_save_it(tmp_path, hooks):
    hooks.at_update(3, pre=inf_gradient, post=lambda opt: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(training.TrainingError, match="became non-finite .* no checkpoint was written yet"):
        train(tmp_path, "bad")
    assert not (tmp_path / "bad" / "checkpoint.pt").exists()


def test_a_second_ctrl_c_aborts_without_saving(tmp_path, hooks):
    hooks.at_update(3, post=lambda opt: (os.kill(os.getpid(), signal.SIGINT), os.kill(os.getpid(), signal.SIGINT)))
    assert train(tmp_path, "twice") == 130
    assert not (tmp_path / "twice" / "checkpoint.pt").exists()


# ---- 5, 6. temporaries and checksums ---------------------------------------------------------------------------
def test_temporaries_of_killed_writes_are_removed(tmp_path):
    dead = tmp_path / ".checkpoint.pt.tmp999999999"  # no such process
    dead.write_bytes(b"x" * 1000)
    save_checkpoint({"model": {"w": torch.ones(2)}, "model_args": {}, "config": {}}, tmp_path / "checkpoint.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_flipped_byte_in_the_weights_is_caught(base, tmp_path):
    raw = bytearray((base / "checkpoint.pt").read_bytes())
    head = load_checkpoint(base)["model"]["head.weight"].numpy().tobytes()
    at = raw.find(head[:64])
    assert at > 0
    raw[at + 5] ^= 0x10
    flipped = tmp_path / "flipped.pt"
    flipped.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="do not match the checksum"):
        load_checkpoint(flipped)
    with pytest.raises(CheckpointError, match="do not match the checksum"):
        eval_cmd.main([str(flipped), "--resolutions", "16", "--out", str(tmp_path / "e")])
    assert not load_checkpoint(flipped, verify=False)["model"]["head.weight"].equal(load_checkpoint(base)["model"]["head.weight"])
    assert eval_cmd.main([str(flipped), "--resolutions", "16", "--no-verify", "--out", str(tmp_path / "e2")]) == 0


# ---- 7. 16-bit images ----------------------------------------------------------------------------------
def test_16_bit_grayscale_pngs_are_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    pictures = {"train": (ramp, ramp[::-1]), "test": (ramp.T, ramp.T[::-1])}  # four different pictures: no copies to drop
    for split in ("train", "test"):
        for c, picture in zip(("a", "b"), pictures[split]):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.ascontiguousarray(picture)).save(tmp_path / split / c / "x.png")  # a 16-bit PNG
    assert Image.open(tmp_path / "train" / "a" / "x.png").mode.startswith("I")
    ds = load_dataset(f"imagefolder:{tmp_path}", image_size=(32, 32))
    x = ds.split(True, (32, 32))[0][0, 0].float()
    expected = torch.from_numpy(ramp.astype(np.float64) / 257)
    assert (x - expected).abs().max() <= 4  # bicubic resize at the same size rounds; clipping would give 255 almost everywhere
    Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32)).save(tmp_path / "train" / "a" / "f.tiff")
    with pytest.raises(DataError, match=r"f\.tiff has floating-point pixels"):
        load_dataset(f"imagefolder:{tmp_path}", image_size=(32, 32))
    (tmp_path / "train" / "a" / "f.tiff").unlink()
    # A 16-bit PGM opens in PIL's 32-bit mode: scaled as 16 bits. A 32-bit TIFF holding 0..255 once became black (/257):
    # its range is unknown, so it is refused as the page says.
    Image.fromarray(ramp).save(tmp_path / "train" / "b" / "p.pgm")
    from vitpe.data.images import open_image

    assert Image.open(tmp_path / "train" / "b" / "p.pgm").mode == "I"
    assert abs(np.asarray(open_image(tmp_path / "train" / "b" / "p.pgm"))[..., 0].astype(float) - ramp / 257).max() <= 0.5
    Image.fromarray((np.arange(64).reshape(8, 8) * 4).astype(np.int32)).save(tmp_path / "train" / "a" / "i.tiff")
    with pytest.raises(DataError, match=r"i\.tiff has 32-bit integer pixels \(0\.\.252\) with no known range"):
        load_dataset(f"imagefolder:{tmp_path}", image_size=(32, 32))


# ---- 8. values YAML reads oddly ---------------------------------------------------------------------------
def test_scientific_notation_and_numeric_names(tmp_path):
    cfg = tmp_path / "sci.yaml"
    cfg.write_text(Path(TINY).read_text().replace("lr: 0.001", "lr: 5e-4"))
    assert train_cmd.main(["--config", str(cfg), "--out-dir", str(tmp_path), "--name", "2024", "--epochs", "1",
                              "--set", "train.min_lr=1e-6"]) == 0
    saved = load_checkpoint(tmp_path / "2024")["config"]
    assert saved["train"]["lr"] == 5e-4 and saved["train"]["min_lr"] == 1e-6 and saved["name"] == "2024"
    assert train(tmp_path, "yes", "--epochs", "1", "--set", "train.lr=3e-4") == 0
    assert load_checkpoint(tmp_path / "yes")["config"]["name"] == "yes"


# ---- 9. metrics survive an interrupt during evaluation ----------------------------------------------------------
def test_ctrl_c_during_evaluation_keeps_that_epochs_metrics(base, tmp_path, monkeypatch):
    real = training.evaluate

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(training, "evaluate", interrupted)
    assert train(tmp_path, "ev") == 130
    monkeypatch.undo()
    rows = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1] and load_checkpoint(tmp_path / "ev")["epoch"] == 1
    assert train_cmd.main(["--resume", str(tmp_path / "ev")]) == 0
    assert same_weights(load_checkpoint(tmp_path / "ev")["model"], load_checkpoint(base)["model"])


# ---- 10. one process per run directory --------------------------------------------------------------------------
def test_a_run_in_use_is_refused_naming_its_process(base):
    with RunLock(base):
        with pytest.raises(RunError, match=f"is in use by process {os.getpid()}"):
            train_cmd.main(["--resume", str(base)])
    code = f"from vitpe.runs import RunLock; import time\nwith RunLock({str(base)!r}):\n    print('locked', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunError, match=f"is in use by process {child.pid}"):
            train_cmd.main(["--resume", str(base)])
    finally:
        child.kill()
        child.wait()
    with RunLock(base):  # the kernel released it with the process
        pass


# ---- 11. a hung rank ----------------------------------------------------------------------------------------------
def test_a_hung_rank_stops_the_run_with_its_name_within_the_timeout(tmp_path):
    port = free_port()
    script = (
        "import os, sys, time\nimport vitpe.training as train\nfrom vitpe.cli.train import cli\nreal = train.seed_step\n"
        "def seed_step(*p):\n"
        "    if os.environ['RANK'] == '1' and p[1:] == (0, 2):\n        time.sleep(60)\n"
        "    real(*p)\n"
        "train.seed_step = seed_step\n"
        "sys.exit(cli(sys.argv[1:]))\n"
    )
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        argv = ["--config", TINY, "--set", "train.device=cpu", "--set", "train.dist_timeout_s=3", "--out-dir", str(tmp_path), "--name", "hung"]
        procs.append(subprocess.Popen([sys.executable, "-c", script, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        t0 = time.time()
        _, err = procs[0].communicate(timeout=50)
        assert procs[0].returncode == 1 and time.time() - t0 < 45
        assert "no answer from the other processes within train.dist_timeout_s=3s; rank 1 stopped answering at epoch 1 step 2" in err, err
        assert len(err.strip().splitlines()) == 1
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ---- 12. bad values: one line each, with the valid range ----------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("model.num_heads=0", r"model\.num_heads=0 is out of range; it must be in \[1, inf\)"),
    ("model.embed_dim=0", r"model\.embed_dim=0 is out of range"),
    ("model.depth=0", r"model\.depth=0 is out of range"),
    ("model.embed_dim=33", r"model\.embed_dim=33 must be divisible by num_heads=2"),
    ("model.drop_path_rate=2", r"model\.drop_path_rate=2\.0 is out of range; it must be in \[0, 1\)"),
    ("train.label_smoothing=5", r"train\.label_smoothing=5\.0 is out of range"),
    ("data.train_size=-5", r"data\.train_size=-5 is out of range"),
    ("train.eval_batch_size=0", r"train\.eval_batch_size=0 is out of range"),
    ("train.lr=0", r"train\.lr=0\.0 is out of range; it must be in \(0, inf\)"),
])
def test_out_of_range_values_are_one_clear_line(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        train(tmp_path, "x", "--set", override)
    assert not (tmp_path / "x").exists()


def test_other_bad_inputs_are_one_clear_line(base, tmp_path, monkeypatch, capsys):
    for bad in (["--batch-size", "0"], ["--batch-size", "-1"], ["--test-size", "-3"]):
        with pytest.raises(SystemExit):
            eval_cmd.main([str(base), *bad])
        assert "must be at least 1" in capsys.readouterr().err
    state = load_checkpoint(base)
    del state["optimizer"]
    (tmp_path / "noopt").mkdir()
    save_checkpoint({k: v for k, v in state.items() if k not in ("format", "checksum")}, tmp_path / "noopt" / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="has no 'optimizer' state: it can be evaluated"):
        train_cmd.main(["--resume", str(tmp_path / "noopt")])
    a_file = tmp_path / "afile"
    a_file.write_text("")
    with pytest.raises(RunError, match="is a file, not a directory"):
        train_cmd.main(["--config", TINY, "--out-dir", str(a_file)])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  depth: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+, column \d+"):
        train_cmd.main(["--config", str(bad_yaml)])
    big = tmp_path / "big"
    for split in ("train", "test"):
        for c in ("a", "b"):
            (big / split / c).mkdir(parents=True)
            Image.new("RGB", (64, 64)).save(big / split / c / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DataError, match=r"huge\.png is too large to decode safely"):
        load_dataset(f"imagefolder:{big}")


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(base, tmp_path, monkeypatch, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "full" / "checkpoint.pt"))

    monkeypatch.setattr(training, "save_checkpoint", full)
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", TINY, "--out-dir", str(tmp_path), "--name", "full"])
    assert train_cmd.cli() == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: No space left on device") and len(err.splitlines()) == 1
    monkeypatch.setattr(evaluation, "plot_accuracy", full)
    monkeypatch.setattr(sys, "argv", ["eval.py", str(base), "--resolutions", "16", "--out", str(tmp_path / "ev")])
    assert eval_cmd.cli() == 1
    assert "No space left on device" in capsys.readouterr().err
    # the finished rows stay, each file whole (written beside, then renamed); no temporary file is left
    assert [r["resolution"] for r in json.loads((tmp_path / "ev" / "results.json").read_text())] == ["16"]
    assert not list((tmp_path / "ev").glob(".*.tmp"))


def test_a_study_reuses_a_run_only_when_its_config_is_the_one_asked_for():
    from vitpe.config import load_config
    from vitpe.runs import config_changes

    stored = load_config(TINY).to_dict()
    asked = json.loads(json.dumps(stored))
    asked["name"], asked["out_dir"] = "elsewhere", "/tmp/x"  # where a run lives is not what it trained
    assert config_changes(stored, asked) == []
    asked["train"]["lr"], asked["model"]["coord_aug"] = 0.5, {"shift": 1.0}
    assert config_changes(stored, asked) == [f"model.coord_aug: {stored['model']['coord_aug']!r} -> {{'shift': 1.0}}",
                                             f"train.lr: {stored['train']['lr']!r} -> 0.5"]
    # A train.budget_min run records the epochs its budget allowed: a different count is its own decision, not a change.
    stored["train"]["budget_min"] = asked["train"]["budget_min"] = 3.0
    stored["train"]["epochs"], asked["train"]["lr"], asked["model"]["coord_aug"] = 7, stored["train"]["lr"], stored["model"]["coord_aug"]
    assert config_changes(stored, asked) == []
    # A train.steps run (a fine-tune's recipe) records the epochs and warm-up its steps came to on its data.
    stored["train"]["budget_min"] = asked["train"]["budget_min"] = None
    stored["train"]["steps"] = asked["train"]["steps"] = 160
    stored["train"]["epochs"], stored["train"]["warmup_epochs"] = 1, 0.1
    assert config_changes(stored, asked) == []
    asked["train"]["steps"] = 320
    assert config_changes(stored, asked) == ["train.steps: 160 -> 320"]


def test_a_study_run_killed_before_its_first_checkpoint_is_resumed_and_one_from_another_recipe_refused(tmp_path, capsys):
    from benchmarks.studykit import TrainSpec, train_or_reuse
    from vitpe.config import apply_overrides, load_config, save_config

    run = tmp_path / "study-row-seed0"
    run.mkdir()  # what a kill in the first epoch leaves: the directory and its config, no checkpoint
    save_config(apply_overrides(load_config(TINY), [f"name={run.name}", f"out_dir={tmp_path}"]), run / "config.yaml")
    assert train_or_reuse(run, TrainSpec(TINY), "row") == run
    assert "resuming" in capsys.readouterr().out and load_checkpoint(run)["epoch"] == 2
    assert train_or_reuse(run, TrainSpec(TINY), "row") == run and "reusing finished run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"another config than this study asks for \(model.pos_embed: 'sincos2d' -> 'rope_axial'\)"):
        train_or_reuse(run, TrainSpec(TINY, ("model.pos_embed=rope_axial",)), "row")


@pytest.mark.parametrize("rc, message", [(143, "stopped by SIGTERM: run the same command again to resume it"),
                                         (130, "stopped by SIGINT: run the same command again to resume it"),
                                         (1, "failed with exit code 1")])
def test_a_study_run_stopped_by_a_signal_says_it_resumes(tmp_path, monkeypatch, rc, message):
    """A study stopped with SIGTERM (train.py saved a checkpoint and returned 128 + 15) says how to go on, not that
    training failed; a real failure still reports its exit code."""
    from benchmarks import studykit

    monkeypatch.setattr(studykit, "train", lambda *args, **kwargs: rc)
    with pytest.raises(SystemExit, match=message):
        studykit.train_or_reuse(tmp_path / "study-row-seed0", studykit.TrainSpec(TINY), "row")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_stopped_by_a_signal_at_a_large_size_keeps_its_finished_rows_within_seconds(base, tmp_path, signum):
    """eval.py at 512 px (16,384 tokens, seconds per image): the 16-px row is on disk as soon as it finishes (what a
    kill -9 leaves), and Ctrl-C or SIGTERM in the middle of the large size stops the sweep within seconds (attention runs
    in pieces between which Python handles signals; once a single call lasted minutes), writes the finished row with its
    summary and exits 128 + the signal. Stopped before any size finished, it leaves no empty folder."""
    out = tmp_path / "ev"
    cmd = [sys.executable, "-m", "vitpe", "eval", str(base), "--resolutions", "16", "512", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "results.json").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        rows = json.loads((out / "results.json").read_text())
        assert [r["resolution"] for r in rows] == ["16"]  # on disk before the sweep ends
        time.sleep(3)  # well inside the 512-px size
        assert proc.poll() is None, proc.communicate()
        sent = time.time()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert time.time() - sent < 15, err
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert f"interrupted ({signal.Signals(signum).name}): the 1 sizes that finished are in {out}" in err
    assert [r["resolution"] for r in json.loads((out / "results.json").read_text())] == ["16"]
    assert (out / "summary.json").exists() and not list(out.glob(".*.tmp"))
    # stopped before any size finished: nothing written, and no eval-* folder left in the run
    proc = subprocess.Popen([sys.executable, "-m", "vitpe", "eval", str(base), "--resolutions", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum and "before any size finished; nothing written" in err, err
    assert not list(base.glob("eval-*"))


_MEASURE_STEPS = r"""
import gc, json, sys, torch, vitpe
from vitpe.engine import train_step_bytes
torch.set_num_threads(2)

def rss(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

out = []
for pe in vitpe.list_pos_embeds():
    for size in (48, 64, 80):
        torch.manual_seed(0)
        m = vitpe.VisionTransformer(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0, pos_embed=pe,
                                    pool="mean", num_classes=10)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x, y = torch.randn(16, 3, size, size), torch.randint(0, 10, (16,))
        def step():
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if not out:  # the thread pools and the allocator's arenas exist before the first measured step
            step()
        gc.collect()
        base = rss("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here
        step()
        out.append((pe, size, rss("VmHWM") - base, train_step_bytes(m, (size, size), 16)))
        del m, opt
        gc.collect()
print(json.dumps(out))
"""


_MEASURE_INFERENCE = r"""
import gc, json, torch, vitpe, onnxruntime
from vitpe.engine import forward_bytes
from vitpe.onnx import export_onnx, onnx_refusal
torch.set_num_threads(2)

def rss(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))

def peak(run):
    gc.collect()
    base = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    run()
    return rss("VmHWM") - base

out = []
for pe in vitpe.list_pos_embeds():
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3, mlp_ratio=2.0, pos_embed=pe,
                                pool="mean", num_classes=10).eval()
    path = None if onnx_refusal(m) else export_onnx(m, f"{TMP}/{pe}.onnx")
    with torch.no_grad():
        m(torch.randn(1, 3, 32, 32))  # the thread pools exist before the first measured forward
    for size in (128, 160, 192):
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            measured = peak(lambda: m(x))
        m.pos_embed.clear_cache()  # the next size builds its tables as a new run would
        shared, each = forward_bytes(m, (size, size))
        out.append((pe, size, "torch", measured, shared + 2 * each))
        if path is not None:
            session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
            measured = peak(lambda: session.run(None, {"images": x.numpy()}))
            del session
            shared, each = forward_bytes(m, (size, size), None, explicit=True)
            out.append((pe, size, "onnxruntime", measured, shared + 2 * each))
print(json.dumps(out))
"""


def test_the_inference_memory_plans_are_within_1_5x_of_a_measured_forward_for_every_family(tmp_path):
    """The plans eval.py and the export's --check make before running a size (vitpe.engine.forward_bytes: PyTorch's fused
    attention, and onnxruntime's explicit one) against the peak memory of a real forward of two images, for every family
    at three sizes (every exportable family in onnxruntime too). lookhere once measured 2x its plan, liere 12x, and the
    --check plan did not count onnxruntime's attention scores at all."""
    pytest.importorskip("onnxruntime")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a forward's peak memory")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    code = _MEASURE_INFERENCE.replace("{TMP}", str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    families = __import__("vitpe").list_pos_embeds()
    assert {pe for pe, *_ in rows} == set(families) and sum(r[2] == "onnxruntime" for r in rows) >= 3 * (len(families) - 3)
    off = [(pe, size, engine, round(measured / 2**20), round(plan / 2**20)) for pe, size, engine, measured, plan in rows
           if not measured / 1.5 <= plan <= 1.5 * measured]
    assert not off, f"plans (MiB) more than 1.5x from the measured forward: {off}"


def test_the_training_memory_plan_is_within_1_5x_of_a_measured_step_for_every_family():
    """The plan a run checks before its first step (vitpe.engine.train_step_bytes) against the peak memory of a real
    training step (resident set size, glibc made to return every large block), for every family at three sizes of the
    main job's model. A bias with trainable parameters (rel_bias, cpb, fire) once measured 3x its plan."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure a step's peak memory")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    run = subprocess.run([sys.executable, "-c", _MEASURE_STEPS], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 * len(__import__("vitpe").list_pos_embeds())
    off = [(pe, size, round(measured / 2**20), round(plan / 2**20)) for pe, size, measured, plan in rows
           if not measured / 1.5 <= plan <= 1.5 * measured]
    assert not off, f"plans (MiB) more than 1.5x from the measured step: {off}"
