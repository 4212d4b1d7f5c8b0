"""Image folders as tar shards (vitpe.data.shards, vitpe shards): written once with the folder's guarantees, read by the
webdataset library, each process its own shards, and runs that resume bit-exactly whatever the loader's workers."""
import json
import os
import shutil
import signal as signal_module
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_data import write_images
from test_train_eval import assert_same_weights, signal_after_update

from vitpe import training
from vitpe.checkpoint import load_checkpoint
from vitpe.cli import main as vitpe_main
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError
from vitpe.data import load_dataset
from vitpe.data.images import DataError
from vitpe.data.shard_writer import shard_count, write_shards
from vitpe.data.shards import ShardBatches, read_index

pytest.importorskip("webdataset")
TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")


def photos(root: Path, per_class: int = 20, test: int = 4) -> Path:
    write_images(root / "train", per_class=per_class, size=(40, 60))
    write_images(root / "test", per_class=test, first=per_class, size=(40, 60))
    return root


def run_args(tmp_path, shards, *more):
    return ["--config", TINY, "--data", f"shards:{shards}", "--set", "model.img_size=16", "--set", "train.batch_size=8",
            "--set", "data.crop_scale=[0.3, 1.0]", "--set", "train.amp=none", "--out-dir", str(tmp_path / "runs"), *more]


def test_shards_hold_the_folder_once_with_its_labels_and_give_its_pixels(tmp_path, capsys):
    root = photos(tmp_path / "imgs")
    shutil.copy(root / "train" / "cat" / "0.png", root / "train" / "cat" / "again.png")  # a copy: written once
    shutil.copy(root / "train" / "dog" / "2.png", root / "test" / "dog" / "leak.png")  # a training picture in the test split: dropped there
    assert vitpe_main(["shards", str(root), str(tmp_path / "s"), "--shards", "8"]) == 0
    out = capsys.readouterr().out
    assert "again.png" in out and "leak.png" in out and "--data shards:" in out
    index = read_index(tmp_path / "s")
    folder = load_dataset(f"imagefolder:{root}", image_size=(16, 16), stream=True)
    assert len(index.files[True]) == 8 and [len(s) for s in index.labels[True]] == [5] * 8
    ds = load_dataset(f"shards:{tmp_path / 's'}", image_size=(16, 16))
    assert ds.classes == folder.classes and ds.fingerprint == folder.fingerprint and ds.mean == pytest.approx(folder.mean)
    assert sorted(ds.split(True)[1].tolist()) == sorted(folder.split(True)[1].tolist())
    assert "40 training pictures in 8 shards and 8 test pictures" in ds.notes[0]
    x, y = ds.split(False)
    assert torch.equal(y, folder.split(False)[1]) and torch.equal(torch.cat([x[0:3], x[3:8]]), folder.split(False)[0][:])
    with pytest.raises(DataError, match="read in order, a slice at a time"):
        x[[0, 2]]
    # every training picture once, in some shard, with its label
    batches = ShardBatches(index, lambda s: training.StepPlan(s, None, (16, 16), None), slice(None), 0, 4, 0, 0, 1, 9, 0)
    got = [b for _, b in batches]
    images, labels = torch.cat([b[0] for b in got]), torch.cat([b[1] for b in got])
    label_of = {x.numpy().tobytes(): int(c) for x, c in zip(folder.split(True)[0][:], folder.split(True)[1])}
    assert images.shape == (36, 3, 16, 16) and len({x.numpy().tobytes() for x in images}) == 36
    assert all(label_of[x.numpy().tobytes()] == int(c) for x, c in zip(images, labels))
    with pytest.raises(DataError, match="already exists; give a new folder"):
        write_shards(root, tmp_path / "s")
    assert shard_count(2000) == 64 and shard_count(64_001) == 128 and shard_count(36) == 36


def test_shards_that_are_missing_or_misused_are_refused_in_one_line(tmp_path):
    root = photos(tmp_path / "imgs", per_class=6, test=2)
    write_shards(root, tmp_path / "s", shards=2, log=lambda line: None)
    with pytest.raises(DataError, match="has no shards.json; write an image folder as shards with: vitpe shards FOLDER"):
        load_dataset(f"shards:{tmp_path}")
    with pytest.raises(DataError, match="data.train_size=4 is fewer than the 12 pictures of shards:"):
        load_dataset(f"shards:{tmp_path / 's'}", train_size=4)
    with pytest.raises(ConfigError, match="train.max_tokens packs pictures chosen by index"):
        train_cmd.main([*run_args(tmp_path, tmp_path / "s"), "--set", "train.max_tokens=64"])
    with pytest.raises(ConfigError, match="data.stream=false: tar shards are read in order"):
        train_cmd.main([*run_args(tmp_path, tmp_path / "s"), "--set", "data.stream=false"])
    with pytest.raises(DataError, match="13 shards for 12 train pictures; ask for 12 or fewer"):
        write_shards(root, tmp_path / "t", shards=13, log=lambda line: None)
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()
    (tmp_path / "s" / "train-000001.tar").unlink()
    with pytest.raises(DataError, match="1 of the shards shards.json lists are missing"):
        load_dataset(f"shards:{tmp_path / 's'}")


def test_a_run_on_shards_resumes_bit_exactly_and_reads_the_same_batches_with_any_workers(tmp_path, monkeypatch, capsys):
    photos(tmp_path / "imgs")
    write_shards(tmp_path / "imgs", tmp_path / "s", shards=8, log=lambda line: None)
    seen = []
    real = training.Job.update

    def update(job, net, x, target, progress):
        seen.append((x.detach().clone(), target.clone()))
        return real(job, net, x, target, progress)

    monkeypatch.setattr(training.Job, "update", update)
    args = run_args(tmp_path, tmp_path / "s", "--epochs", "2", "--set", "train.resolutions=[8, 16]")
    assert train_cmd.main([*args, "--set", "data.workers=0", "--name", "w0"]) == 0
    assert "40 training pictures in 8 shards" in capsys.readouterr().out
    ref = list(seen)
    assert {x.shape[-1] for x, _ in ref} == {8, 16} and len(ref) == 10  # 40 pictures, batch 8: 5 steps an epoch
    seen.clear()
    handle = signal_after_update("SIGINT", 7)  # mid-epoch, at a step the first of two workers would not start at
    try:
        assert train_cmd.main([*args, "--set", "data.workers=2", "--name", "cut"]) == 128 + signal_module.SIGINT
    finally:
        handle.remove()
    assert train_cmd.main(["--resume", str(tmp_path / "runs" / "cut")]) == 0
    assert len(seen) == 10 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen, ref))
    assert_same_weights(load_checkpoint(tmp_path / "runs" / "cut")["model"], load_checkpoint(tmp_path / "runs" / "w0")["model"])
    # an epoch reads each training picture once, in a new order each epoch
    labels = [torch.cat([t for _, t in ref[e * 5 : (e + 1) * 5]]) for e in (0, 1)]
    assert all(sorted(lab.tolist()) == [0] * 20 + [1] * 20 for lab in labels) and not torch.equal(*labels)


def test_eval_and_a_broken_picture_on_shards(tmp_path, capsys):
    from vitpe.cli import eval as eval_cmd

    photos(tmp_path / "imgs")
    (tmp_path / "imgs" / "train" / "cat" / "3.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="cannot read image .*3.png"):  # found while the folder is read, before any shard is written
        write_shards(tmp_path / "imgs", tmp_path / "s", log=lambda line: None)
    (tmp_path / "imgs" / "train" / "cat" / "3.png").unlink()
    write_shards(tmp_path / "imgs", tmp_path / "s", shards=4, log=lambda line: None)
    assert train_cmd.main(run_args(tmp_path, tmp_path / "s", "--epochs", "1", "--name", "r")) == 0
    capsys.readouterr()
    assert eval_cmd.main([str(tmp_path / "runs" / "r"), "--resolutions", "16", "24", "12x20", "--diagnostics", "0",
                          "--out", str(tmp_path / "ev")]) == 0
    rows = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert {(r["height"], r["width"]) for r in rows} >= {(16, 16), (24, 24), (12, 20)} and all(r["n"] == 8 for r in rows)
    # a shard whose picture cannot be decoded stops the run in one line naming the shard and the sample
    import tarfile

    shard = tmp_path / "s" / "train-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for m, data in members:
            data = b"\x89PNG broken" if m.name.endswith(".png") else data
            m.size = len(data)
            tar.addfile(m, __import__("io").BytesIO(data))
    rc = train_cmd.cli(run_args(tmp_path, tmp_path / "s", "--epochs", "1", "--name", "bad"))
    err = capsys.readouterr().err
    assert rc != 0 and "cannot read image train-000000.tar:" in err and "Traceback" not in err


def test_torchrun_two_processes_read_their_own_shards(tmp_path, monkeypatch):
    root = Path(__file__).parents[1]
    photos(tmp_path / "imgs")
    write_shards(tmp_path / "imgs", tmp_path / "s", shards=8, log=lambda line: None)
    index = read_index(tmp_path / "s")
    plan = lambda s: training.StepPlan(s, None, (8, 8), None)  # noqa: E731
    mine = [ShardBatches(index, plan, slice(None), 0, 5, 0, r, 2, 4, 0).mine_shards for r in (0, 1)]
    assert len(mine[0]) == len(mine[1]) == 4 and not set(mine[0]) & set(mine[1])  # its own half of the shards, none shared
    with pytest.raises(DataError, match="8 training shards for 16 processes"):
        ShardBatches(index, plan, slice(None), 0, 5, 0, 0, 16, 4, 0)
    args = run_args(tmp_path, tmp_path / "s", "--epochs", "2", "--set", "train.device=cpu", "--set", "data.augment=crop_flip")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533", "train.py", *args, "--name", "two"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cpu x2" in r.stdout and "2/2" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 <= row["test_top1"] <= 1 for row in rows)
