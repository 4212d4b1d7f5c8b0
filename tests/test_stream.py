"""Image folders read a batch at a time (vitpe.data.stream): the same guarantees as the in-memory path, memory bounded
by the batch, crops from the original photo, and runs that resume bit-exactly with DataLoader workers."""
import json
import shutil
import signal as signal_module
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_data import write_images
from test_train_eval import assert_same_weights, signal_after_update

from vitpe import training
from vitpe.checkpoint import load_checkpoint
from vitpe.cli import train as train_cmd
from vitpe.data import load_dataset, memory
from vitpe.data.images import DataError, open_image
from vitpe.data.stream import FolderSplit, decode_at, in_memory_bytes, stream_memory

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


def test_a_streamed_folder_holds_paths_and_gives_the_pixels_the_in_memory_path_gives(tmp_path):
    write_images(tmp_path / "a" / "train", per_class=5)
    write_images(tmp_path / "a" / "val", per_class=2, first=5)
    held = load_dataset(f"imagefolder:{tmp_path / 'a'}", image_size=(16, 16), stream=False)
    streamed = load_dataset(f"imagefolder:{tmp_path / 'a'}", image_size=(16, 16), stream=True)
    assert streamed.streamed and not held.streamed and streamed.classes == held.classes == ("cat", "dog")
    x, y = streamed.split(True)
    assert isinstance(x, FolderSplit) and x.shape == (10, 3, 16, 16) and torch.equal(y, held.split(True)[1])
    # the whole picture resized once, bicubic, as the in-memory path resizes it: the same pixels
    assert torch.equal(x[:], held.split(True)[0]) and torch.equal(streamed.split(False)[0][[1, 3]], held.split(False)[0][[1, 3]])
    assert streamed.mean == pytest.approx(held.mean, abs=0.02) and streamed.images_at(True, torch.tensor([2]), (8, 12)).shape == (1, 3, 8, 12)
    assert "14 image files, read a batch at a time (data.stream=true; held in memory they take about" in streamed.notes[0]
    assert held.notes[0].endswith("held in memory (data.stream=false)") and streamed.fingerprint.startswith("files:")
    aspects = streamed.aspects(True)
    assert torch.allclose(aspects, torch.full((10,), 30 / 20))  # from the files' headers


def test_the_choice_follows_the_folders_size_against_the_memory_and_is_said_first(tmp_path):
    write_images(tmp_path / "f", per_class=10)
    assert in_memory_bytes(20, (224, 224)) == 20 * 224 * 224 * 9 and stream_memory(20, (224, 224), 4 * in_memory_bytes(20, (224, 224)) - 1)
    small = load_dataset(f"imagefolder:{tmp_path / 'f'}", image_size=(16, 16), memory=2**30)
    assert not small.streamed and "20 image files, held in memory (about" in small.notes[0] and "data.stream=true reads" in small.notes[0]
    tight = load_dataset(f"imagefolder:{tmp_path / 'f'}", image_size=(16, 16), memory=4 * in_memory_bytes(20, (16, 16)) - 1)
    assert tight.streamed and "read a batch at a time (held in memory they take about" in tight.notes[0]
    assert "data.stream=false holds them" in tight.notes[0]


def test_copies_are_found_by_their_bytes_and_kept_off_both_sides_of_the_split(tmp_path):
    root = tmp_path / "c"
    write_images(root / "train", per_class=4)
    write_images(root / "test", per_class=2, first=4)
    shutil.copy(root / "train" / "cat" / "0.png", root / "train" / "cat" / "again.png")  # a copy in one class: kept once
    shutil.copy(root / "train" / "cat" / "1.png", root / "train" / "dog" / "which.png")  # in two classes: in neither
    shutil.copy(root / "train" / "dog" / "2.png", root / "test" / "dog" / "leak.png")  # a training image in the test split
    ds = load_dataset(f"imagefolder:{root}", image_size=(8, 8), stream=True)
    notes = " | ".join(ds.notes)
    assert len(ds.split(True)[1]) == 7 and len(ds.split(False)[1]) == 4  # cat: 0 (or again), 2, 3; dog: 0-3; test: 4, 5 each
    assert "appear more than once in one class (the same bytes" in notes and "again.png" in notes
    assert "more than one class (the same bytes" in notes and "which.png" in notes and "leak.png" in notes
    write_images(root / "test", classes=("horse",), per_class=1, first=9)
    with pytest.raises(DataError, match="train and test have different class folders"):
        load_dataset(f"imagefolder:{root}", image_size=(8, 8), stream=True)


def test_a_crop_is_cut_from_the_original_and_a_jpeg_decodes_only_as_finely_as_needed(tmp_path):
    board = (np.indices((64, 64)).sum(0) % 2 * 255).astype(np.uint8)  # 1-px detail that a 16-px copy cannot keep
    Image.fromarray(np.stack([board] * 3, -1)).save(tmp_path / "board.png")
    top_left = decode_at(str(tmp_path / "board.png"), (16, 16), (0.0, 0.0, 0.25, 0.25))
    assert torch.equal(top_left[0], torch.from_numpy(board[:16, :16]))
    photo = np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8).repeat(10, 0).repeat(10, 1)  # 600x800, 10-px blocks
    Image.fromarray(photo).save(tmp_path / "photo.jpg", quality=95)
    fast = decode_at(str(tmp_path / "photo.jpg"), (30, 40)).float()
    full = torch.from_numpy(np.array(Image.open(tmp_path / "photo.jpg").convert("RGB").resize((40, 30), Image.BICUBIC))).permute(2, 0, 1).float()
    assert fast.shape == (3, 30, 40) and (fast - full).abs().mean() < 10  # decoded at 1/8 scale, then resized: the same picture
    im = Image.fromarray(photo[:200, :300])
    exif = im.getexif()
    exif[0x0112] = 6  # a phone held upright: the stored 300x200 picture shows 200 wide, 300 high
    im.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    upright = open_image(tmp_path / "phone.jpg")
    assert upright.size == (200, 300)
    expected = torch.from_numpy(np.array(upright.resize((16, 24), Image.BICUBIC))).permute(2, 0, 1).float()
    assert (decode_at(str(tmp_path / "phone.jpg"), (24, 16)).float() - expected).abs().mean() < 10


def run_args(tmp_path, folder, *more):
    return ["--config", TINY, "--data", f"imagefolder:{folder}", "--set", "model.img_size=16", "--set", "train.batch_size=8",
            "--set", "data.crop_scale=[0.3, 1.0]", "--set", "train.amp=none", "--out-dir", str(tmp_path / "runs"), *more]


def test_a_folder_larger_than_the_memory_cap_trains_streamed_and_resumes_bit_exactly_with_workers(tmp_path, monkeypatch, capsys):
    write_images(tmp_path / "imgs", per_class=20, size=(40, 60))
    # The test's memory cap: a quarter of it is less than the folder would take in memory at 16 px.
    cap = 4 * in_memory_bytes(40, (16, 16)) - 1
    monkeypatch.setattr(memory, "host_memory_available", lambda: cap)
    seen = []
    real = training.Job.update

    def update(job, net, x, target, progress):
        seen.append(x.detach().clone())
        return real(job, net, x, target, progress)

    monkeypatch.setattr(training.Job, "update", update)
    args = run_args(tmp_path, tmp_path / "imgs", "--epochs", "2", "--set", "data.workers=2", "--set", "train.resolutions=[8, 16]")
    assert train_cmd.main([*args, "--name", "full"]) == 0
    out = capsys.readouterr().out
    assert "image files, read a batch at a time (held in memory they take about" in out
    assert load_checkpoint(tmp_path / "runs" / "full")["data"]["streamed"] is True
    full_batches = list(seen)
    assert {x.shape[-1] for x in full_batches} == {8, 16} and len(full_batches) == 8  # 36 training images, batch 8: 4 steps an epoch
    seen.clear()
    handle = signal_after_update("SIGINT", 6)
    try:
        assert train_cmd.main([*args, "--name", "cut"]) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**40)  # a resume keeps the run's choice, whatever is free now
    assert train_cmd.main(["--resume", str(tmp_path / "runs" / "cut")]) == 0
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen, full_batches))  # the same pixels at every step
    assert_same_weights(load_checkpoint(tmp_path / "runs" / "cut")["model"], load_checkpoint(tmp_path / "runs" / "full")["model"])


def test_workers_and_the_training_process_read_the_same_batches(tmp_path, monkeypatch):
    write_images(tmp_path / "imgs", per_class=12)
    for workers in (0, 2):
        assert train_cmd.main(run_args(tmp_path, tmp_path / "imgs", "--epochs", "1", "--set", "data.stream=true",
                                       "--set", f"data.workers={workers}", "--name", f"w{workers}")) == 0
    assert_same_weights(load_checkpoint(tmp_path / "runs" / "w0")["model"], load_checkpoint(tmp_path / "runs" / "w2")["model"])
    rows = [json.loads(line) for line in (tmp_path / "runs" / "w2" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0 <= rows[0]["test_top1"] <= 1


def test_a_picture_that_cannot_be_read_stops_the_run_in_one_line_naming_it(tmp_path, capsys):
    write_images(tmp_path / "imgs", per_class=12)
    (tmp_path / "imgs" / "cat" / "3.png").write_bytes(b"\x89PNG broken")
    rc = train_cmd.cli(run_args(tmp_path, tmp_path / "imgs", "--epochs", "1", "--set", "data.stream=true", "--name", "bad"))
    err = capsys.readouterr().err
    assert rc != 0 and "cannot read image" in err and "3.png" in err and "Traceback" not in err


def test_eval_reads_a_streamed_run_as_it_trained_at_every_size(tmp_path, capsys):
    from vitpe.cli import eval as eval_cmd

    write_images(tmp_path / "imgs", per_class=12)
    assert train_cmd.main(run_args(tmp_path, tmp_path / "imgs", "--epochs", "1", "--set", "data.stream=true", "--name", "s")) == 0
    capsys.readouterr()
    assert eval_cmd.main([str(tmp_path / "runs" / "s"), "--resolutions", "16", "24", "12x20", "--diagnostics", "0", "--out", str(tmp_path / "ev")]) == 0
    assert "read a batch at a time (data.stream=true" in capsys.readouterr().err
    rows = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert {(r["height"], r["width"]) for r in rows} >= {(16, 16), (24, 24), (12, 20)} and all(r["n"] == 2 for r in rows)


def test_torchrun_two_processes_on_a_streamed_folder_match_one_process(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    write_images(tmp_path / "imgs", per_class=20)
    args = run_args(tmp_path, tmp_path / "imgs", "--epochs", "1", "--set", "data.stream=true", "--set", "train.device=cpu",
                    "--set", "data.augment=crop_flip")
    assert train_cmd.main([*args, "--name", "one"]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531", "train.py", *args, "--name", "two"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout
    # each process decoded its half of every batch; the augmentation drew for the whole batch, as one process does
    assert_same_weights(load_checkpoint(tmp_path / "runs" / "two")["model"], load_checkpoint(tmp_path / "runs" / "one")["model"], exact=False)


def test_stream_is_for_folders_and_workers_serve_data_held_in_memory_too(tmp_path):
    from vitpe.config import ConfigError

    with pytest.raises(ConfigError, match="data.stream=true reads an image folder a batch at a time; shapes is held in memory"):
        train_cmd.main(["--config", TINY, "--set", "data.stream=true", "--out-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"data.workers=-1 is out of range"):
        train_cmd.main(["--config", TINY, "--set", "data.workers=-1", "--out-dir", str(tmp_path)])
    for workers in (0, 2):
        assert train_cmd.main(["--config", TINY, "--epochs", "1", "--set", f"data.workers={workers}", "--set", "data.crop_scale=[0.5, 1.0]",
                               "--set", "train.amp=none", "--out-dir", str(tmp_path), "--name", f"w{workers}"]) == 0
    assert_same_weights(load_checkpoint(tmp_path / "w0")["model"], load_checkpoint(tmp_path / "w2")["model"])


def test_the_pages_streaming_table_is_the_record():
    """docs/data.md's rows are what benchmarks/streaming.py --report makes of docs/data/streaming.jsonl."""
    from conftest import load_benchmark

    study = load_benchmark("streaming")
    table = study.report(study.read())
    assert table == (study.RECORD.parent / "table.md").read_text()
    page = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    assert all(line in page for line in table.splitlines() if line.startswith("| ") and "---" not in line)


def test_a_decoded_cache_cuts_the_crops_a_decode_gives_and_lives_as_long_as_the_run(tmp_path, capsys):
    from vitpe.config import ConfigError
    from vitpe.data.stream import DecodedCache, cache_slot

    assert cache_slot(32, [0.35, 1.0], [0.75, 1.3333]) == (63, 63) and cache_slot(48, None, [0.75, 1.3333]) == (48, 48)
    photo = np.random.default_rng(1).integers(0, 256, (12, 16, 3), dtype=np.uint8).repeat(40, 0).repeat(40, 1)  # 480x640, 40-px blocks
    Image.fromarray(photo).save(tmp_path / "photo.jpg", quality=95)
    cache = DecodedCache(tmp_path / "c.u8", 3, cache_slot(32, [0.35, 1.0], [0.75, 1.3333]))
    box = (0.2, 0.3, 0.55, 0.6)
    first = cache.cut(2, str(tmp_path / "photo.jpg"), (32, 32), box)
    assert cache.filled.tolist() == [0, 0, 1]
    assert torch.equal(cache.cut(2, b"not read again", (32, 32), box), first)  # from the slot: the file is not decoded twice
    direct = decode_at(str(tmp_path / "photo.jpg"), (32, 32), box).float()
    assert (first.float() - direct).abs().mean() < 6  # the slot holds what the crop shows: the same picture
    cache.close()
    assert not list(tmp_path.glob("c.*"))
    write_images(tmp_path / "imgs", per_class=12)
    assert train_cmd.main(run_args(tmp_path, tmp_path / "imgs", "--epochs", "2", "--set", "data.stream=true", "--name", "k")) == 0
    out = capsys.readouterr().out
    assert "data.cache: training pictures are kept decoded at 34x34 px in decoded-0.u8" in out
    assert not list((tmp_path / "runs" / "k").glob("decoded-*"))  # deleted when the run stops
    assert train_cmd.main(run_args(tmp_path, tmp_path / "imgs", "--epochs", "1", "--set", "data.stream=true", "--set", "data.cache=false",
                                   "--name", "n")) == 0
    assert "data.cache" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="data.cache=true keeps pictures read from files decoded; shapes is held in memory"):
        train_cmd.main(["--config", TINY, "--set", "data.cache=true", "--out-dir", str(tmp_path)])
