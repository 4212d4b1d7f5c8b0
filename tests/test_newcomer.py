"""What a newcomer meets (issue 16): which weights a number comes from, warnings for schedules that cannot work,
progress in logs, one-line errors for foreign files, prediction on image files, finite attention distances."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import vitpe
from vitpe import training, viz
from vitpe.checkpoint import CheckpointError, load_checkpoint
from vitpe.cli import train as train_cmd
from vitpe.cli.common import run_cli
from vitpe.cli.predict import main as predict_main
from vitpe.config import load_config
from vitpe.engine import Heartbeat

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    args = ["--config", TINY, "--out-dir", str(out), "--name", "ema", "--epochs", "1", "--set", "train.warmup_epochs=2",
            "--set", "train.ema_decay=0.999"]
    return out / "ema", args


def test_ema_runs_say_whose_numbers_they_print_and_warn_about_schedules_that_cannot_work(ema_run, capsys, caplog):
    run, args = ema_run
    assert train_cmd.main(args) == 0
    out = capsys.readouterr().out
    assert "warning: train.warmup_epochs=2 covers the whole 1-epoch run" in out
    assert "warning: train.ema_decay=0.999 averages over about 1000 steps but the run has 8" in out
    assert "test (EMA weights) loss" in out and "(EMA weights; eval.py --no-ema for the raw ones)" in out
    assert "Cosine annealing scheduler" not in out + caplog.text  # timm's notice, said above in vitpe's words
    assert "note: test top-1" in out  # one epoch at chance: the undertrained hint


def test_no_warnings_for_a_sound_schedule():
    cfg = load_config(str(Path(TINY).parent / "shapes.yaml"))
    assert training.schedule_warnings(cfg, 156, 5000) == []  # the main job: 8 epochs x 156 steps, 5,000 test images


def test_warnings_where_the_numbers_say_a_run_cannot_work():
    cfg = load_config(str(Path(TINY).parent / "shapes.yaml"))
    few, small = training.schedule_warnings(cfg, 11, 30)  # 1,500 images in batches of 128: 88 steps; 30 test images
    assert few.startswith("88 optimizer steps (8 epochs x 11) are far too few") and "--epochs 110" in few
    assert small.startswith("the test split has 30 images: each is 3.3 points of top-1")


def test_undertrained_hint():
    rows = [{"test_top1": 0.50}, {"test_top1": 0.58}]
    assert "rose 8.0 points in the last epoch" in training.undertrained_hint(rows, 10, 7)
    assert "--epochs 14" in training.undertrained_hint(rows, 10, 7)
    assert "--set train.budget_min=30" in training.undertrained_hint(rows, 10, 7, budget_min=15)  # a budget decided the epochs
    assert "near chance" in training.undertrained_hint([{"test_top1": 0.12}], 10, 1)
    assert training.undertrained_hint([{"test_top1": 0.90}, {"test_top1": 0.905}], 10, 7) is None
    # A climb that the last epoch's dip hides (38.05% after 39.06%) is read from the trend, with the command to go on.
    climb = [{"train_acc": a, "test_top1": t} for a, t in ((0.20, 0.21), (0.27, 0.30), (0.33, 0.35), (0.37, 0.3906), (0.40, 0.3805))]
    hint = training.undertrained_hint(climb, 10, 8, run=Path("runs/r"))
    assert "over the last 3 epochs (their trend): the run stopped while still learning" in hint
    assert hint.endswith("python train.py --config runs/r/config.yaml --epochs 16 --name r-longer")
    flat = [{"train_acc": 0.95, "test_top1": t} for t in (0.90, 0.91, 0.90, 0.905, 0.90)]
    assert training.undertrained_hint(flat, 10, 8) is None


def test_the_main_jobs_recipe_finds_its_measured_reference():
    """The main job's last lines compare with pos_embed=none as measured (vitpe/reference_runs.json): a config key added
    since then takes its default there, so the recipe still matches."""
    assert training.reference_results(load_config(str(Path(TINY).parent / "shapes.yaml"))) is not None


def test_a_schedule_sized_by_work_on_data_the_recipe_was_not_written_for():
    recipe = load_config(str(Path(TINY).parent / "shapes.yaml"))  # 8 epochs of 156 steps on shapes' 20,000 images
    assert training.recipe_work(recipe)[:2] == (1248, 0.3 * 156)
    folder = training.apply_overrides(recipe, ["data.name=imagefolder:x"])
    line = training.work_schedule(recipe, folder, ["data.name=imagefolder:x"], 11, 1500)
    assert folder.train.epochs == 114 and folder.train.warmup_epochs == round(0.3 * 156 / 11, 3)
    assert line.startswith("schedule sized by work: the recipe was written for shapes (8 epochs = 1,248 optimizer steps); "
                           "1,500 training images make 11 steps an epoch, so 114 epochs (1,254 steps")
    for chosen in (["train.epochs=5"], ["train.budget_min=3"]):  # the user's choice stands
        cfg = training.apply_overrides(recipe, ["data.name=imagefolder:x", *chosen])
        assert training.work_schedule(recipe, cfg, ["data.name=imagefolder:x", *chosen], 11, 1500) is None
    assert training.work_schedule(recipe, recipe, [], 156, 20000) is None  # the recipe's own data
    steps = training.apply_overrides(recipe, ["data.name=imagefolder:x", "train.steps=2000", "train.warmup_steps=100"])
    line = training.work_schedule(recipe, steps, ["data.name=imagefolder:x", "train.steps=2000", "train.warmup_steps=100"], 23, 3000)
    assert steps.train.epochs == 87 and steps.train.warmup_epochs == round(100 / 23, 3) and line.startswith("schedule sized by work: train.steps=2,000;")
    with pytest.raises(training.ConfigError, match="both decide the epochs"):
        training.apply_overrides(recipe, ["train.steps=2000", "train.budget_min=3"])


def test_the_last_lines_say_what_position_bought_and_compare_with_the_measured_none(tmp_path):
    cfg = load_config(str(ROOT / "configs" / "shapes.yaml"))
    ds = vitpe.data.load_dataset("shapes", train_size=1, test_size=1)
    per = [0.99] * 5 + [0.90, 0.92, 0.94, 0.96] + [0.99]
    row = {"test_top1": 0.95, "test_per_class_top1": per}
    lines = training.learned_lines(row, ds, cfg)
    assert len(lines) == 1 and lines[0].startswith("learned: 93.0% on the 4 classes only position tells apart (circle above square")
    assert "chance on them: 25%)" in lines[0] and "99.0% on the other 6" in lines[0]
    # The recipe's measured results are found by recipe: the PE and the seed are not part of it, the epochs are.
    other = load_config(str(ROOT / "configs" / "shapes.yaml"))
    other.model.pos_embed, other.train.seed = "none", 3
    ref = {"measured": "2026-11-23, test CPU", "recipe": training.recipe_of(other),
           "results": {"none": {"seeds": [0, 1], "top1": [0.70, 0.72], "position_top1": [0.26, 0.24]}}}
    path = tmp_path / "reference.json"
    path.write_text(json.dumps([ref]))
    found = training.reference_results(cfg, path)
    assert found == ref
    lines = training.learned_lines(row, ds, cfg, found)
    assert lines[1] == ("without a PE (pos_embed=none) the same recipe reached 71.0% (25.0% on those 4 classes; measured 2026-11-23, "
                        "test CPU, seeds [0, 1]): sincos2d adds +24.0 points")
    other.train.epochs = 99
    assert training.reference_results(other, path) is None and training.reference_results(cfg, tmp_path / "missing.json") is None
    # Data without position-only classes, or a run without a PE: no comparison with itself.
    assert training.learned_lines(row, dataclasses.replace(ds, position_classes=()), cfg, found) == []
    cfg.model.pos_embed = "none"
    assert len(training.learned_lines(row, ds, cfg, found)) == 1


def test_heartbeat_prints_progress_lines_with_the_time_left():
    lines = []
    beat = Heartbeat("epoch 1/3 step", 100, every=0.0, log=lines.append)
    beat.tick(25, " | train loss 1.234")
    assert len(lines) == 1 and lines[0].startswith("epoch 1/3 step: 25/100 (25%)") and "left | train loss 1.234" in lines[0]
    quiet = Heartbeat("x", 100, every=3600.0, log=lines.append)
    quiet.tick(50)
    assert len(lines) == 1  # at most one line per interval


def test_foreign_files_are_refused_in_one_line_with_the_right_diagnosis(tmp_path):
    for name, content in [("h.pt", b"hello, not a checkpoint"), ("config.yaml", b"model:\n  img_size: 16\n"), ("bin.pt", b"\x00\x01\x02\x03")]:
        f = tmp_path / name
        f.write_bytes(content)
        with pytest.raises(CheckpointError, match=r"is not a vitpe checkpoint: it is a (text|binary) file"):
            load_checkpoint(f)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is empty"):
        load_checkpoint(tmp_path / "empty.pt")


def test_attention_distance_is_finite_when_a_head_attends_only_to_the_class_token(monkeypatch):
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed="none")
    real = type(m.blocks[0].attn).attention_logits

    def on_cls(self, x, pos=None, layer=0):
        logits = real(self, x, pos, layer)
        logits[:, 0, :, 0] = 1e4  # head 0 looks only at the class token: no patch attention left to measure
        return logits

    monkeypatch.setattr(type(m.blocks[0].attn), "attention_logits", on_cls)
    d = viz.attention_distance(m, torch.randn(2, 3, 16, 16))
    assert torch.isnan(d[:, 0]).all() and torch.isfinite(d[:, 1]).all()  # no patch distance: NaN, never a division by 0


def test_predict_prints_the_top_classes_of_image_files(tmp_path, capsys):
    from PIL import Image

    from vitpe.data import load_dataset

    out = tmp_path / "runs"
    assert train_cmd.main(["--config", TINY, "--out-dir", str(out), "--name", "p", "--epochs", "1"]) == 0
    ds = load_dataset("shapes", train_size=64, test_size=8)
    x, _ = ds.split(False, (16, 16))
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(x[i].permute(1, 2, 0).numpy()).save(paths[-1])
    capsys.readouterr()
    assert predict_main([*paths, "--run", str(out / "p"), "--top", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in rows] == paths and all(len(r["top"]) == 2 for r in rows)
    assert all(r["top"][0]["p"] >= r["top"][1]["p"] and r["top"][0]["class"] in ds.classes for r in rows)
    # the same as the model on the same pixels
    model, _ = vitpe.checkpoint.model_from_checkpoint(out / "p")
    from vitpe.data.augment import normalize

    with torch.no_grad():
        want = model(normalize(x[:2], ds.mean, ds.std)).argmax(-1).tolist()
    assert [ds.classes.index(r["top"][0]["class"]) for r in rows] == want
    assert predict_main([paths[0], "--run", str(out / "p"), "--size", "24x32"]) == 0  # another resolution
    assert capsys.readouterr().out.startswith(f"{paths[0]}: ")  # the path as given
    assert run_cli(predict_main, [str(tmp_path / "missing.png"), "--run", str(out / "p")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert run_cli(predict_main, [paths[0], "--run", str(out / "p"), "--size", "30"]) == 2
    assert "not a multiple of patch_size" in capsys.readouterr().err


def test_two_evaluations_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    import time

    from vitpe.cli import eval as eval_cmd

    out = tmp_path / "runs"
    assert train_cmd.main(["--config", TINY, "--out-dir", str(out), "--name", "e", "--epochs", "1"]) == 0
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261122-120000")  # the same second, twice
    for _ in range(2):
        assert eval_cmd.main([str(out / "e"), "--resolutions", "16"]) == 0
    assert sorted(p.name for p in (out / "e").glob("eval-*")) == ["eval-20261122-120000", "eval-20261122-120000-2"]


def test_the_folder_recipe_trains_a_folder_by_steps_and_the_study_table_reads_its_record(tmp_path, capsys):
    import numpy as np
    from conftest import load_benchmark
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for j in range(20):
            arr = np.full((20, 20, 3), 60 + 120 * (c == "b"), dtype=np.uint8)
            arr[j % 20, : 20 - j // 20] = 255
            Image.fromarray(arr).save(tmp_path / "imgs" / c / f"{j}.png")
    folder_yaml = str(Path(TINY).parent / "folder.yaml")
    assert train_cmd.main(["--config", folder_yaml, "--data", f"imagefolder:{tmp_path / 'imgs'}", "--set", "train.steps=12",
                              "--set", "train.warmup_steps=2", "--set", "train.batch_size=8", "--set", "model.depth=1",
                              "--out-dir", str(tmp_path / "runs"), "--name", "f"]) == 0
    assert ("schedule sized by work: train.steps=12; 36 training images make 4 steps an epoch, so 3 epochs (12 steps, "
            "warm-up 0.5 epochs)") in capsys.readouterr().out
    assert load_config(str(tmp_path / "runs" / "f" / "config.yaml")).train.epochs == 3  # the decision is kept for --resume
    sf = load_benchmark("small_folders")
    record = tmp_path / "r.csv"
    record.write_text("folder,row,seed,epochs,steps,train_s,top1,args,when\n"
                      "digits,plain,0,114,1254,180.6,0.9865,,x\ndigits,plain,1,114,1254,180.3,0.9933,,x\n")
    assert "| digits | plain | 2 | 114 | 1254 | 180-181 | 99.0 ± 0.5 (min 98.7) |" in sf.table(record)
