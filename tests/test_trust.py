"""Data you can trust (docs/reliability.md, "What a hostile user tried"): image folders never feed one picture to both
sides of a split and say what they skipped; checkpoints know their classes by name; memory is bounded or refused up
front; files vitpe writes load back; images are read upright."""
import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitpe
from vitpe import evaluation, training
from vitpe.checkpoint import CheckpointError
from vitpe.cli import eval as eval_cmd
from vitpe.cli import predict as predict_cmd
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError
from vitpe.data import DataError, load_dataset
from vitpe.data.images import open_image, read_images
from vitpe.engine import MemoryPlanError
from vitpe.runs import RunError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def picture(k: int, size=(16, 16)) -> np.ndarray:
    """A picture of its own for every k (a white run of k + 1 pixels on a grey ground)."""
    arr = np.full((*size, 3), 90, dtype=np.uint8)
    arr.reshape(-1, 3)[: k + 1] = 255
    return arr


def folder(root: Path, classes=("a", "b"), per_class=10, start=0) -> Path:
    for i, c in enumerate(classes):
        (root / c).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            Image.fromarray(picture(start + 100 * i + j)).save(root / c / f"{j}.png")
    return root


def all_digests(ds) -> list:
    return [bytes(x.numpy()) for split in (True, False) for x in ds.split(split)[0]]


# ---- 1. no picture on both sides of a split -------------------------------------------------------------
def test_a_link_loop_and_copies_count_each_picture_once(tmp_path):
    root = folder(tmp_path / "f", per_class=2)  # 4 pictures
    os.symlink("..", root / "a" / "loop")  # a/loop -> the folder itself: every picture again, without end
    shutil.copy(root / "a" / "0.png", root / "a" / "copy.png")  # the same bytes under another name
    os.symlink(root / "b" / "0.png", root / "b" / "link.png")  # a second link to one file
    ds = load_dataset(f"imagefolder:{root}", image_size=(16, 16))
    x = all_digests(ds)
    assert len(x) == 4 and len(set(x)) == 4  # 4 pictures, each on one side of the split only
    notes = " | ".join(ds.notes)
    assert "links to folders already read" in notes and "a/loop" in notes
    assert "appear more than once in one class" in notes and "copy.png" in notes and "link.png" in notes


def test_a_picture_in_two_classes_is_left_out_and_test_copies_of_training_images_are_dropped(tmp_path):
    root = folder(tmp_path / "f", per_class=10)
    shutil.copy(root / "a" / "3.png", root / "b" / "stray.png")  # same pixels, two labels
    ds = load_dataset(f"imagefolder:{root}", image_size=(16, 16))
    assert len(all_digests(ds)) == 19 and any("more than one class" in n and "stray.png" in n for n in ds.notes)
    split = tmp_path / "s"
    folder(split / "train", per_class=6)
    folder(split / "test", per_class=3, start=50)
    shutil.copy(split / "train" / "a" / "0.png", split / "test" / "a" / "leak.png")
    ds = load_dataset(f"imagefolder:{split}", image_size=(16, 16))
    train, test = {bytes(x.numpy()) for x in ds.split(True)[0]}, [bytes(x.numpy()) for x in ds.split(False)[0]]
    assert len(test) == 6 and not train & set(test)
    assert any("copies of training images" in n and "leak.png" in n for n in ds.notes)


def test_hidden_files_other_files_and_gifs(tmp_path):
    root = folder(tmp_path / "f", per_class=3)
    (root / ".git" / "objects").mkdir(parents=True)  # not a class
    (root / "a" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS metadata, not a picture
    (root / "a" / "notes.txt").write_text("hello")
    Image.fromarray(picture(77)).save(root / "b" / "anim.gif")
    ds = load_dataset(f"imagefolder:{root}", image_size=(16, 16))
    assert ds.classes == ("a", "b") and len(all_digests(ds)) == 7  # the GIF is read
    notes = " | ".join(ds.notes)
    assert "hidden files and folders" in notes and ".git/" in notes and "._0.png" in notes and "notes.txt" in notes


def test_one_class_and_empty_class_folders_are_one_line(tmp_path):
    folder(tmp_path / "one", classes=("only",))
    with pytest.raises(DataError, match=r"has 1 class folder \(only\); a classifier needs at least 2 classes"):
        load_dataset(f"imagefolder:{tmp_path / 'one'}")
    folder(tmp_path / "empty")
    (tmp_path / "empty" / "c").mkdir()
    with pytest.raises(DataError, match="class folder c has no images vitpe reads"):
        load_dataset(f"imagefolder:{tmp_path / 'empty'}")


# ---- 5. photos the right way up -------------------------------------------------------------------------
def test_exif_orientation_is_applied_in_folders_and_predict(tmp_path):
    arr = np.zeros((8, 16, 3), dtype=np.uint8)
    arr[:, :8] = 255  # left half white, as stored (a landscape sensor image)
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to view": a phone held upright
    im.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    upright = np.asarray(open_image(tmp_path / "phone.jpg"))
    assert upright.shape == (16, 8, 3) and upright[:8].mean() > 200 and upright[8:].mean() < 50  # the white half on top
    x = read_images([tmp_path / "phone.jpg"], 3, (16, 8))
    assert x[0, :, :8].float().mean() > 200 and x[0, :, 8:].float().mean() < 50


# ---- 2. class identity ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cls")
    data = folder(tmp / "data", classes=("a", "b", "c"), per_class=12)
    assert train_cmd.main(["--config", TINY, "--data", f"imagefolder:{data}", "--set", "train.batch_size=8", "--epochs", "2",
                              "--out-dir", str(tmp / "runs"), "--name", "r", "--set", "train.time_limit_min=0.0001"]) == 0
    return tmp, data, tmp / "runs" / "r"


def test_resume_and_eval_check_class_names(folder_run, tmp_path):
    _, data, run = folder_run
    mine = tmp_path / "data"
    shutil.copytree(data, mine)
    assert train_cmd.main(["--config", TINY, "--data", f"imagefolder:{mine}", "--set", "train.batch_size=8", "--epochs", "2",
                              "--out-dir", str(tmp_path), "--name", "r", "--set", "train.time_limit_min=0.0001"]) == 0
    assert torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["data"]["classes"] == ["a", "b", "c"]
    os.rename(mine / "b", mine / "d")  # same count, another class: the head's row for "b" would now mean "d"
    with pytest.raises(CheckpointError, match=r"was trained on classes a, b, c but imagefolder:.* has other classes \(b no longer there; d new\)"):
        train_cmd.main(["--resume", str(tmp_path / "r")])
    with pytest.raises(CheckpointError, match=r"was trained on classes a, b, c but imagefolder:.* has other classes \(b no longer there; d new\)"):
        eval_cmd.main([str(run), "--data", f"imagefolder:{mine}", "--resolutions", "16", "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()


def test_a_checkpoint_from_another_run_is_not_resumed_under_this_runs_config(folder_run, tmp_path):
    _, data, run = folder_run
    assert train_cmd.main(["--config", TINY, "--data", f"imagefolder:{data}", "--set", "train.batch_size=8", "--epochs", "2",
                              "--set", "model.embed_dim=48", "--out-dir", str(tmp_path), "--name", "big",
                              "--set", "train.time_limit_min=0.0001"]) == 0
    mine = tmp_path / "mine"
    shutil.copytree(run, mine)
    shutil.copy(tmp_path / "big" / "checkpoint.pt", mine / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"is not this run's: .*model.embed_dim: 48 -> 32|model.embed_dim: 32 -> 48"):
        train_cmd.main(["--resume", str(mine)])


# ---- 3. memory without bound ----------------------------------------------------------------------------
def test_eval_refuses_a_size_that_cannot_fit_before_anything_runs(folder_run, tmp_path, monkeypatch):
    _, _, run = folder_run
    monkeypatch.setattr(eval_cmd, "evaluate_at", lambda *a, **k: pytest.fail("evaluated a size that cannot fit"))
    monkeypatch.setattr(vitpe.engine, "memory_available", lambda device: 2**30)
    with pytest.raises(MemoryPlanError, match=r"resolution 4096x4096 needs about \d+\.\d GiB for one image in .* up to about \d+x\d+"):
        eval_cmd.main([str(run), "--resolutions", "16", "4096", "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()


def test_eval_lowers_the_batch_where_memory_is_short_and_makes_large_splits_batch_by_batch(folder_run, tmp_path, monkeypatch, capsys):
    _, _, run = folder_run
    model, _ = vitpe.checkpoint.model_from_checkpoint(run)
    shared, each = vitpe.engine.forward_bytes(model, (64, 64))
    assert shared == 0 and each > 0  # sincos2d adds no attention bias
    monkeypatch.setattr(vitpe.engine, "memory_available", lambda device: 2 * 3 * each)  # 3 images at 64x64
    plan = vitpe.engine.memory_plan(model, [((16, 16), None), ((64, 64), None), ((192, 192), 48)], 8, torch.device("cpu"), "run", (16, 16))
    assert plan == {(16, 16): 8, (64, 64): 3, (192, 192): 8}  # the patch route at 192 keeps the trained 4x4 grid
    err = capsys.readouterr().err
    assert "images per batch lowered to fit memory at 64x64: 3" in err
    assert "64x64 has 257 tokens per image: 229x the attention work of the training size 16x16 (17 tokens)" in err
    rel = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, pos_embed="rel_bias")
    look = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, pos_embed="lookhere")
    # heads x tokens^2 floats as built and as padded, and the int64 index: one table for rel_bias, one per block for lookhere
    assert vitpe.engine.forward_bytes(rel, (64, 64))[0] == 4 * 257**2 * (2 * 2 + 2)
    assert vitpe.engine.forward_bytes(look, (64, 64))[0] == 4 * 257**2 * (2 * 2 * 2 + 2)
    ds = load_dataset("shapes", train_size=8, test_size=40)
    lazy, labels = ds.split_at(False, (48, 48), max_bytes=1000)
    whole = ds.split(False, (48, 48))[0]
    assert type(lazy).__name__ == "LazySplit" and len(lazy) == 40 and torch.equal(lazy[8:16], whole[8:16]) and torch.equal(labels, ds.split(False)[1])


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["model:", "  pos_embed_kwargs:", "    a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"    {name}: &{name} [{', '.join([f'*{prev}'] * 10)}]")  # 10^9 values once expanded
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="more than 100,000 values once its YAML aliases"):
        train_cmd.main(["--config", str(bomb)])


def test_predict_refuses_a_decompression_bomb_and_bad_top_in_one_line(folder_run, tmp_path, monkeypatch, capsys):
    _, _, run = folder_run
    Image.new("RGB", (64, 64)).save(tmp_path / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    from vitpe.cli.common import run_cli

    assert run_cli(predict_cmd.main, [str(tmp_path / "huge.png"), "--run", str(run)]) == 1
    assert "huge.png is too large to decode safely" in capsys.readouterr().err
    for top in ("0", "-2"):
        with pytest.raises(SystemExit) as e:
            predict_cmd.main([str(tmp_path / "huge.png"), "--run", str(run), "--top", top])
        assert e.value.code == 2 and "--top must be at least 1" in capsys.readouterr().err


def test_predict_takes_a_file_whose_name_starts_with_a_dash(folder_run, tmp_path, monkeypatch, capsys):
    _, data, run = folder_run
    monkeypatch.chdir(tmp_path)
    shutil.copy(data / "a" / "0.png", tmp_path / "-dash.png")
    assert predict_cmd.main(["-dash.png", "--run", str(run), "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("-dash.png: ")
    with pytest.raises(SystemExit):
        predict_cmd.main(["-nofile.png", "--run", str(run)])
    assert "put -- before it" in capsys.readouterr().err


# ---- 4. files that cannot be read back ------------------------------------------------------------------
def test_an_equipped_timm_model_saves_loads_copies_and_traces_safely():
    timm = pytest.importorskip("timm")
    import copy

    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4, depth=2)
    vitpe.equip_timm_vit(m, "rel_bias")
    m.eval()
    x = torch.randn(2, 3, 32, 48)
    ref = m(x)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.allclose(torch.load(buf, weights_only=False)(x), ref)
    m.train()(x).sum().backward()  # a context with gradients in flight is not copied with the model
    assert torch.allclose(copy.deepcopy(m).eval()(x), ref)
    m.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(m, x)
    assert not any("refuses other sizes" in str(w.message) for w in caught)
    assert torch.allclose(traced(x), ref, atol=1e-5)
    for hw in ((48, 32), (64, 80)):  # the same token count transposed (once other logits, silently), and larger
        y = torch.randn(2, 3, *hw)
        with torch.no_grad():
            assert torch.allclose(traced(y), m(y), atol=1e-5)
    with pytest.raises(ValueError, match="already carries vitpe's 'rel_bias' PE"):
        vitpe.vit_from_timm(m)


@pytest.mark.parametrize("pe", vitpe.list_pos_embeds())
def test_a_traced_vitpe_model_runs_at_any_size_or_refuses_other_sizes(pe):
    """torch.jit.trace records the sizes as values, as an ONNX export does: the traced module computes coordinates and
    tables from each input's size, for every family (once it failed with TorchScript's shape message at any other
    size). A PE that chooses per size in Python (learned.square) is pinned to the traced size: refused, never wrong."""
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed=pe,
                                num_reg_tokens=1).eval()
    x = torch.randn(1, 3, 16, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, x)  # torch's own check (a second trace) passes: no cached table
    with torch.no_grad():
        for hw in ((16, 24), (24, 16), (32, 40), (8, 12)):
            y = torch.randn(2, 3, *hw)
            assert torch.allclose(traced(y), m(y), atol=1e-5), hw
    square = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                                     pos_embed="learned", pos_embed_kwargs={"square": True}).eval()
    with pytest.warns(UserWarning, match="refuses other sizes"):
        traced = torch.jit.trace(square, x)
    with pytest.raises(RuntimeError):
        traced(torch.randn(1, 3, 24, 16))


# ---- 6. smaller ---------------------------------------------------------------------------------------
def test_input_dtypes_and_token_keep():
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3).eval()
    x = torch.randn(2, 3, 16, 16)
    ref = m(x)
    assert torch.allclose(m(x.half()), ref, atol=1e-2) and m(x.bfloat16()).dtype == torch.float32
    assert m.double()(x).dtype == torch.float64
    with pytest.raises(ValueError, match="expected floating-point images, got torch.uint8; normalize them first"):
        m(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    for bad in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match=rf"token_keep must be in \(0, 1\], got {bad}"):
            m(x.double(), token_keep=bad)


def test_dot_names_are_refused(tmp_path):
    for name in (".", ".."):
        with pytest.raises(RunError, match="names a folder that is not a run's own"):
            train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", name])


def test_eval_checks_its_output_first_keeps_finished_rows_on_ctrl_c_and_names_datasets(folder_run, tmp_path, monkeypatch, capsys):
    tmp, _, run = folder_run
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    monkeypatch.setattr(eval_cmd, "evaluate_at", lambda *a, **k: pytest.fail("evaluated before checking --out"))
    with pytest.raises(ConfigError, match="exists and is not an empty directory"):
        eval_cmd.main([str(run), "--resolutions", "16", "--out", str(full)])
    monkeypatch.undo()
    real = evaluation.evaluate_at

    def one_then_ctrl_c(*args, **kwargs):
        for i, row in enumerate(real(*args, **kwargs)):
            if i == 1:
                raise KeyboardInterrupt
            yield row

    monkeypatch.setattr(eval_cmd, "evaluate_at", one_then_ctrl_c)
    out = tmp_path / "cut"
    assert eval_cmd.main([str(run), "--resolutions", "16", "24", "32", "--diagnostics", "0", "--out", str(out)]) == 130
    assert len(json.loads((out / "results.json").read_text())) == 1 and "interrupted (SIGINT): the 1 sizes that finished" in capsys.readouterr().err
    monkeypatch.undo()
    shapes = tmp / "runs"
    assert train_cmd.main(["--config", TINY, "--epochs", "1", "--out-dir", str(shapes), "--name", "s"]) == 0
    two = tmp_path / "two"
    assert eval_cmd.main([str(run), str(shapes / "s"), "--resolutions", "16", "--diagnostics", "0", "--out", str(two)]) == 0
    labels = {r["label"] for r in json.loads((two / "results.json").read_text())}
    assert any(label.endswith(" on shapes") for label in labels) and any(" on imagefolder:" in label for label in labels)


def test_predict_refuses_a_size_that_cannot_fit_and_training_warns_up_front(folder_run, tmp_path, monkeypatch, capsys):
    from vitpe.cli.common import run_cli

    _, data, run = folder_run
    monkeypatch.setattr(vitpe.engine, "memory_available", lambda device: 2**27)
    assert run_cli(predict_cmd.main, [str(data / "a" / "0.png"), "--run", str(run), "--size", "1024"]) == 2
    assert "resolution 1024x1024 needs about" in capsys.readouterr().err
    monkeypatch.setattr(training, "memory_available", lambda device: 1000)
    # past 1.5x of what is available (the plan's measured bound) the run cannot fit: refused before its folder exists
    assert run_cli(train_cmd.main, ["--config", TINY, "--epochs", "1", "--out-dir", str(tmp_path), "--name", "r"]) == 2
    assert "a training step at 16 px needs about" in capsys.readouterr().err and not (tmp_path / "r").exists()
    real = training.train_step_bytes
    monkeypatch.setattr(training, "train_step_bytes", lambda m, size, batch: real(m, size, batch) * 1000 // real(m, size, 32))
    assert run_cli(train_cmd.main, ["--config", TINY, "--epochs", "1", "--out-dir", str(tmp_path), "--name", "r", "--set", "train.batch_size=64"]) == 2
    assert re.search(r"lower train.batch_size to 4[78] or less", capsys.readouterr().err)  # 1.5x the 32 images that fit exactly
    monkeypatch.setattr(training, "memory_available", lambda device: 800)  # within the plan's bound: a warning, then the run
    assert train_cmd.main(["--config", TINY, "--epochs", "1", "--out-dir", str(tmp_path), "--name", "w"]) == 0
    assert "warning: a training step at 16 px may hold up to" in capsys.readouterr().out


def test_more_of_the_same_kind(folder_run, tmp_path, capsys):
    """The next cases found on the same surfaces (docs/reliability.md lists them with the first ones)."""
    _, data, run = folder_run
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))  # fully transparent, with red stored under the transparency
    rgba.save(tmp_path / "t.png")
    assert np.asarray(open_image(tmp_path / "t.png")).min() == 255  # shown as a viewer shows it: the white page
    links = tmp_path / "links"
    shutil.copytree(data, links)
    os.symlink(links / "a", links / "kitty")
    with pytest.raises(DataError, match="class folder kitty is a link to a, read already"):
        load_dataset(f"imagefolder:{links}")
    out = tmp_path / "twice"
    assert eval_cmd.main([str(run), str(run / "checkpoint.pt"), "--resolutions", "16", "--diagnostics", "0", "--out", str(out)]) == 0
    assert len(json.loads((out / "results.json").read_text())) == 1 and "given twice; each is evaluated once" in capsys.readouterr().err
    assert train_cmd.main(["--config", TINY, "--epochs", "1", "--out-dir", str(tmp_path), "--name", "done"]) == 0
    before = (tmp_path / "done" / "checkpoint.pt").stat().st_mtime_ns
    capsys.readouterr()
    assert train_cmd.main(["--resume", str(tmp_path / "done")]) == 0  # a finished run: said, not trained on
    assert "finished all its 1 epochs already" in capsys.readouterr().out and (tmp_path / "done" / "checkpoint.pt").stat().st_mtime_ns == before
    for size in ("0", "-4"):
        with pytest.raises(SystemExit):
            predict_cmd.main([str(data / "a" / "0.png"), "--run", str(run), "--size", size])
        assert "must be positive" in capsys.readouterr().err


def test_nan_and_ill_typed_values_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"train.lr=nan is out of range"):
        train_cmd.main(["--config", TINY, "--set", "train.lr=.nan", "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"coord_aug takes numbers for shift, rescale and jitter"):
        vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, coord_aug={"rescale": [2, 1]})


def test_attention_diagnostics_are_skipped_where_one_images_scores_cannot_fit(folder_run, tmp_path, monkeypatch, capsys):
    _, _, run = folder_run
    model, _ = vitpe.checkpoint.model_from_checkpoint(run)
    monkeypatch.setattr(evaluation, "memory_available", lambda device: 2 * vitpe.engine.attention_bytes(model, (16, 16)))
    assert eval_cmd.main([str(run), "--resolutions", "16", "32", "--diagnostics", "4", "--out", str(tmp_path / "d")]) == 0
    rows = {r["resolution"]: r for r in json.loads((tmp_path / "d" / "results.json").read_text())}
    assert "attn_distance" in rows["16"] and "attn_distance" not in rows["32"]
    assert "no attention diagnostics at 32x32: one image's attention scores would take" in capsys.readouterr().err


def test_training_options_that_would_be_ignored_or_fail_late_are_one_line_first(tmp_path, monkeypatch):
    """train.warmup_steps without train.steps was ignored silently; the warm-up warning of a train.steps run named
    train.warmup_epochs, which that run does not read; a tensorboard that is installed but does not import was a
    traceback after the run folder existed."""
    import importlib.util
    import sys

    from vitpe.config import load_config
    from vitpe.training import schedule_warnings

    with pytest.raises(ConfigError, match="train.warmup_steps=10 is the warm-up of a train.steps run .*set train.steps too"):
        train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "w", "--set", "train.warmup_steps=10"])
    cfg = load_config(TINY)
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.epochs, cfg.train.warmup_epochs = 16, 16, 2, 2.0
    assert any(w.startswith("train.warmup_steps=16 covers the whole 2-epoch run") and w.endswith("lower train.warmup_steps")
               for w in schedule_warnings(cfg, 8))
    cfg.train.steps = cfg.train.warmup_steps = None
    assert any(w.endswith("lower train.warmup_epochs") for w in schedule_warnings(cfg, 8))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "tensorboard" else real(name, *a))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # installed, but its import fails
    with pytest.raises(ConfigError, match="tensorboard package is installed but does not import .*reinstall it"):
        train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "tb", "--set", "train.tensorboard=true"])
    assert not (tmp_path / "w").exists() and not (tmp_path / "tb").exists()


def test_predicts_text_output_is_one_line_per_image_named_by_its_path(folder_run, tmp_path, monkeypatch, capsys):
    """Two 0.png in different folders both printed "0.png:"; a class name with a newline split its line. The text names
    each image by the path given and quotes names that are not printable; --json stays the machine-readable form."""
    _, data, run = folder_run
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        shutil.copy(data / "a" / "0.png", tmp_path / d / "0.png")
    real = evaluation.shipped_model

    def newline_classes(*a, **k):
        model, info = real(*a, **k)
        return model, dict(info, classes=[f"{c}\nsecond line" for c in info["classes"]])

    monkeypatch.setattr(predict_cmd, "shipped_model", newline_classes)
    capsys.readouterr()
    assert predict_cmd.main([str(tmp_path / "x" / "0.png"), str(tmp_path / "y" / "0.png"), "--run", str(run), "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{tmp_path / 'x' / '0.png'}: ") and lines[1].startswith(f"{tmp_path / 'y' / '0.png'}: ")
    assert '\\nsecond line"' in lines[0]
    assert predict_cmd.main([str(tmp_path / "x" / "0.png"), "--run", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top"][0]["class"].endswith("\nsecond line")
