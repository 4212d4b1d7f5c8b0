"""The benchmark scripts' seconds-long smoke modes, so that they do not rot between hand-run studies."""
import argparse
import csv
import json
import math
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import ROOT, load_benchmark

import vitpe
from vitpe.checkpoint import checkpoint_config, load_checkpoint


def test_resolution_transfer_train_minutes_zero_is_a_measurement(tmp_path):
    """A tiny run on a fast machine trains in under 0.05 s, which the record rounds to 0.0: the report shows 0.0, not
    the '-' of a record without a time (a fast VM made the smoke's trained.md flip between the two)."""
    study = load_benchmark("resolution_transfer")
    assert study.train_seconds({"train_time_s": 0.0, "train_wall_s": 7.0}) == 0.0
    assert study.train_seconds({"train_wall_s": 90.0}) == 90.0
    assert study.train_seconds({"train_time_s": float("nan")}) is None and study.train_seconds({}) is None
    entry = {"data": "shapes", "row": "learned", "seed": 0, "epochs": 1, "converged": False, "retrained_with": 2,
             "last_fifth_gain_points": float("nan"), "train_time_s": 0.0}
    table = "\n".join(study.trained_table([entry, {**entry, "train_time_s": None}]))
    assert "| learned | 0 | 1 | - | no: retrained with 2 | 0.0 | 0.00 |" in table
    assert "| learned | 0 | 1 | - | no: retrained with 2 | - | - |" in table
    # The seeds table of table.md averages the times the record has and shows '-' for a row with none.
    rows = [{"data": "shapes", "row": "learned", "pe": "learned", "variant": "", "seed": 0, "train_size": 32,
             "epochs": 1, "converged": False, "label": "interpolate", "route": "coords", "coord_mode": "interpolate",
             "rope_scaling": "none", "column": "1x", "scale": 1, "height": 32, "width": 32, "top1": 0.5,
             "tokens_per_image": 64}]
    study.report(rows, tmp_path)
    assert "| learned | 1 | 1 | - | 0/1 | - | 50.0 |" in (tmp_path / "table.md").read_text()
    study.report([{**rows[0], "train_time_s": 0.0}, {**rows[0], "seed": 1, "train_wall_s": 120.0}], tmp_path)
    assert "| learned | 2 | 1 | 1.0 | 0/2 | - | 50.0 ± 0.0 |" in (tmp_path / "table.md").read_text()


def test_resolution_transfer_smoke(tmp_path, capsys):
    study = load_benchmark("resolution_transfer")
    assert study.main(["--smoke", "--out", str(tmp_path)]) == 0
    # One epoch cannot show convergence: each row is trained again with twice the epochs (the smoke's --max-epochs 2).
    assert "[shapes learned seed 0] still moving after 1 epochs: training 2" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "runs").iterdir()} >= {"shapes-learned-seed0-e1", "shapes-learned-seed0-e2"}
    trained = study.load_trained(tmp_path)  # committed: what a fresh clone knows of the runs
    assert [(e["row"], e["epochs"], e.get("retrained_with")) for e in trained] == [
        ("learned", 1, 2), ("learned", 2, None), ("rope_axial:multires", 1, 2), ("rope_axial:multires", 2, None)]
    assert all(e["config"]["model"]["pos_embed"] == e["row"].partition(":")[0] for e in trained)
    rows = study.load_results(tmp_path)
    assert {r["row"] for r in rows} == {"learned", "rope_axial:multires"} and {r["seed"] for r in rows} == {0}
    columns = {"0.5x", "0.75x", "1x", "1.5x", "2x", "3x", "4x", "12x24", "24x12"}  # tiny.yaml trains at 16 px
    learned = [r for r in rows if r["row"] == "learned"]
    assert {r["column"] for r in learned} == columns and {r["label"] for r in learned} == {"interpolate", "extrapolate", "patch"}
    assert {r["column"] for r in learned if r["label"] == "patch"} == columns - {"12x24", "24x12"}  # the patch route keeps a square grid
    rope = [r for r in rows if r["row"] == "rope_axial:multires"]
    yarn = {r["column"] for r in rope if r["label"] == "extrapolate+yarn"}
    assert yarn == {"1.5x", "2x", "3x", "4x", "12x24", "24x12"}  # the controls only where a side passes the trained extent
    coords = [r for r in rows if r["route"] == "coords" and r["rope_scaling"] == "none"]
    assert all(len(r["attn_entropy"]) == 2 and len(r["attn_distance_ref"]) == 2 for r in coords)  # per layer (depth 2)
    assert all(isinstance(r["converged"], bool) and r["epochs"] == 2 for r in rows)  # the longer run is the one measured
    table = (tmp_path / "table.md").read_text()
    for text in ("## shapes (trained at 16 px)", "| converged | train top-1 | 1x top-1 |", "| learned |", "[cells.csv](cells.csv)",
                 "FIRE: better than RoPE far from the training size: not measured yet", "last layer's attention"):
        assert text in table
    # every cell of every route is a line of cells.csv, a record beside the page (the page stays under 25 KB)
    with open(tmp_path / "cells.csv", newline="") as f:
        cells = list(csv.DictReader(f))
    assert {(c["row"], c["route"]) for c in cells} >= {("learned", "interpolate"), ("learned", "patch"), ("rope_axial:multires", "extrapolate+yarn")}
    assert all(c["seeds"] == "1" and float(c["top1_mean"]) >= 0 for c in cells)
    assert any(c["attn_entropy"] != "" for c in cells if c["route"] == "interpolate")
    assert (tmp_path / "shapes.png").stat().st_size > 5000 and not (tmp_path / "shapes_attention.png").exists()
    summary = (tmp_path / "summary.md").read_text().partition("extrapolated coordinates")[2]
    assert re.search(r"\n\| learned \| [+-]\d+\.\d / [+-]\d+\.\d / [+-]\d+\.\d \| - \| - \| - / - \|", summary)  # one seed: means alone
    runs_md = (tmp_path / "trained.md").read_text()  # every run trained, the shorter of a doubled row too, in row order
    assert "nan" not in runs_md  # one epoch has no last fifth: "-"
    assert re.search(r"\| learned \| 0 \| 1 \| - \| no: retrained with 2 \| \d+\.\d \| \d+\.\d\d \| \d+\.\d \|\n\| learned \| 0 \| 2 \|", runs_md)
    # Run again for one row: nothing is trained or measured again, every result is kept (it starts at the 2 epochs
    # the row needed, so the 1-epoch run is not even opened).
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned"]) == 0
    assert "reusing finished run" in capsys.readouterr().out
    assert [str(r) for r in study.load_results(tmp_path)] == [str(r) for r in rows]  # (nan: a run too short for a last fifth)
    assert "nan" not in (tmp_path / "table.md").read_text()
    # Another machine (a fresh clone) has the committed measurements but not the git-ignored runs: nothing is retrained.
    (tmp_path / "runs").rename(tmp_path / "elsewhere")
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned"]) == 0
    assert "measured before (2 epochs; results.csv, runs.jsonl) and its run is not on this machine" in capsys.readouterr().out
    assert not [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith(".")]  # its claims and lock only
    assert [str(r) for r in study.load_results(tmp_path)] == [str(r) for r in rows]  # (nan: a run too short for a last fifth)
    shutil.rmtree(tmp_path / "runs")
    (tmp_path / "elsewhere").rename(tmp_path / "runs")
    # The recipe changed since (here its learning rate): the runs trained with the old one are refused, not reused.
    with pytest.raises(SystemExit, match=r"shapes-learned-seed0-e2 was trained with another config than this study asks "
                                         r"for \(train.lr: 0.001 -> 0.0123\): move it away"):
        study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned", "--set", "train.lr=0.0123"])
    # Moved away, they are trained again with as many epochs: their new checkpoints are measured, not the old results kept.
    for old in (tmp_path / "runs").glob("shapes-learned-*"):
        old.rename(tmp_path / f"old-{old.name}")
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned", "--set", "train.lr=0.0123"]) == 0
    again = study.load_results(tmp_path)
    assert [r for r in again if r["row"] != "learned"] == [r for r in rows if r["row"] != "learned"]
    relearned = [r for r in again if r["row"] == "learned"]
    assert len(relearned) == len(learned) and all(r["epochs"] == 2 for r in relearned) and relearned != learned


def test_resolution_transfer_report_keeps_a_zero_change(tmp_path):
    # A row that keeps its accuracy at 2x and 4x is the best result the study can report: "+0.0", never "nan".
    study = load_benchmark("resolution_transfer")
    rows = [{"data": "shapes", "row": "sincos2d:multires", "pe": "sincos2d", "variant": "multires", "seed": 0,
             "train_size": 32, "epochs": 12, "converged": True, "train_wall_s": 60.0, "label": "interpolate",
             "route": "coords", "coord_mode": "interpolate", "rope_scaling": "none", "column": c, "scale": k,
             "height": round(32 * k), "width": round(32 * k), "top1": 1.0, "tokens_per_image": round(8 * k) ** 2}
            for c, k in (("1x", 1), ("2x", 2), ("4x", 4))]
    study.report(rows, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "- sincos2d:multires (interpolate): 100.0% at 1x, +0.0 at 2x, +0.0 at 4x" in table and "nan" not in table
    # What is left of the study, from the record itself: the row with seed 0 first (the seeds it needs), then every row with none.
    todo = next(line for line in table.splitlines() if line.startswith("Still to measure on shapes"))
    rows_left = len(study.all_rows())
    others = ", ".join(r for r in study.all_rows() if r != "sincos2d:multires")
    assert todo == f"Still to measure on shapes ({rows_left} of {rows_left} rows): sincos2d:multires (needs seeds 1, 2), {others}."
    done = [dict(r, row=row, seed=seed) for row in study.all_rows() for seed in study.SEEDS for r in rows]
    study.report(done, tmp_path)
    assert "Every row of the study is measured on shapes with seeds 0, 1, 2." in (tmp_path / "table.md").read_text()
    study.report(rows, tmp_path)
    assert study.main(["--report", "--out", str(tmp_path)]) == 0 and (tmp_path / "table.md").read_text() == table
    with pytest.raises(SystemExit, match="unknown study row 'none:aug'"):
        study.main(["--smoke", "--out", str(tmp_path), "--rows", "none:aug"])


def test_resolution_transfer_counts_the_seeds_that_meet_the_target(tmp_path):
    # The shapes target per seed: at least 95% at 1x, then at most 0.5 points lost at 2x and 2 at 4x. A loss
    # of exactly the limit meets it (floats: 0.995 - 1.0 is -0.5000000000000004); a missing 4x cell does not.
    study = load_benchmark("resolution_transfer")
    seeds = {0: (1.0, 0.995, 0.98), 1: (1.0, 0.995, 0.979), 2: (0.94, 0.94, 0.94), 3: (1.0, 1.0, None), 4: (0.97, 0.964, 0.97)}
    rows = [{"data": "shapes", "row": "cpb:multires", "pe": "cpb", "variant": "multires", "seed": seed, "train_size": 32,
             "epochs": 48, "converged": True, "train_wall_s": 60.0, "label": "interpolate", "route": "coords",
             "coord_mode": "interpolate", "rope_scaling": "none", "column": c, "scale": k, "height": 32 * k,
             "width": 32 * k, "top1": t, "tokens_per_image": 64 * k * k}
            for seed, tops in seeds.items() for (c, k), t in zip((("1x", 1), ("2x", 2), ("4x", 4)), tops) if t is not None]
    group = study.cells(rows)
    assert study.target_seeds(group, "shapes", "cpb:multires") == (1, 5)
    assert study.target_seeds(group, "shapes", "cpb:multires", "extrapolate") == (0, 0)
    study.report(rows, tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert study.target_cells(group, "shapes", "cpb:multires")[3] == (100.0, {"2x": 0.0, "4x": None}, False)
    # Each seed's cells, the met ones in bold, so that the docs can cite the per-seed numbers instead of copying them.
    assert ("| cpb:multires | 1 of 5 | **100.0%, -0.5, -2.0** | 100.0%, -0.5, -2.1 | 94.0%, +0.0, +0.0 | 100.0%, +0.0, - | "
            "97.0%, -0.6, +0.0 |") in table, table


def test_resolution_transfer_processes_share_one_out(tmp_path, capsys):
    study = load_benchmark("resolution_transfer")
    # A (data, row, seed) another study process holds is skipped, not trained a second time beside it.
    with study.claim(tmp_path, "shapes", "learned", 0) as mine:
        assert mine
        with study.claim(tmp_path, "shapes", "learned", 0) as again:
            assert not again
        assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned"]) == 0
    assert "[shapes learned seed 0] another study process is on it: skipped" in capsys.readouterr().out
    assert not (tmp_path / "results.csv").exists() and not (tmp_path / "runs" / "shapes-learned-seed0-e1").exists()
    with study.claim(tmp_path, "shapes", "learned", 0) as mine:  # released with its process's hold
        assert mine
    # --jobs 2: two processes split the rows; each row is trained and measured once, and both land in the shared files.
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "learned", "rope_axial", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"--jobs 2: 2 study processes, \d+ threads? each", out) and "2 study processes done" in out
    logs = [(tmp_path / "runs" / f"job{k}.log").read_text() for k in range(2)]
    assert sum(log.count("still moving after 1 epochs") for log in logs) == 2  # each row trained by one process only
    rows = study.load_results(tmp_path)
    keys = [(r["row"], r["label"], r["column"]) for r in rows if r["route"] == "coords" and r["rope_scaling"] == "none"]
    assert {r for r, _, _ in keys} == {"learned", "rope_axial"} and len(keys) == len(set(keys))
    assert sorted((e["row"], e["epochs"]) for e in study.load_trained(tmp_path)) == [
        ("learned", 1), ("learned", 2), ("rope_axial", 1), ("rope_axial", 2)]


def test_resolution_transfer_jobs_pass_a_stop_on_and_resume(tmp_path):
    """SIGTERM to a --jobs study (what Ctrl-C, Slurm or kill send) reaches every study process once: each saves its run
    at a step boundary, and the same command resumes them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, str(ROOT / "benchmarks" / "resolution_transfer.py"), "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--data", "shapes", "--seeds", "0", "--rows", "learned", "rope_axial", "--max-epochs", "40", "--eval-size", "16",
           "--diagnostics", "0", "--set", "train.epochs=40", "--out", str(tmp_path), "--jobs", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    study = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = [tmp_path / "runs" / f"job{k}.log" for k in range(2)]
    deadline = time.time() + 240
    while not all(log.is_file() and "epoch 2/40" in log.read_text() for log in logs):  # both mid-training
        assert study.poll() is None and time.time() < deadline, study.communicate()[0]
        time.sleep(0.5)
    study.send_signal(signal.SIGTERM)
    out = study.communicate(timeout=240)[0]
    assert study.returncode == 128 + signal.SIGTERM and "ended with exit code" not in out, out
    assert "stopped by SIGTERM" in out and "run the same command again to resume" in out
    assert all("SIGTERM at epoch" in log.read_text() and "checkpoint saved" in log.read_text() for log in logs)
    assert not (tmp_path / "results.csv").exists()
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=480).returncode == 0
    resumed = [int(e) for log in logs for e in re.findall(r"resuming \S+ at epoch (\d+)", log.read_text())]
    assert len(resumed) == 2 and min(resumed) > 1  # each stopped run resumed once, where it stopped
    assert {r["row"] for r in load_benchmark("resolution_transfer").load_results(tmp_path)} == {"learned", "rope_axial"}


def test_resolution_transfer_parks_an_unfinished_run_for_the_next_machine(tmp_path, capsys):
    """Run directories are git-ignored and go with their machine: --park copies an unfinished run to a folder outside the
    repository, and a study on a machine without the run goes on from the parked step, then drops the copy. A park
    folder inside the repository is refused: checkpoints never go into git."""
    import os
    import signal

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from benchmarks.studykit import unpark_run
    from vitpe.checkpoint import load_checkpoint
    from vitpe.runs import RunLock

    study = load_benchmark("resolution_transfer")
    cmd = ["--smoke", "--out", str(tmp_path), "--rows", "learned", "--max-epochs", "1", "--park-dir", str(tmp_path / "parked")]
    updates = []

    def stop_at_third(optimizer, args, kwargs):  # the end of a session: SIGTERM, saved at the step boundary
        updates.append(1)
        if len(updates) == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    hook = register_optimizer_step_post_hook(stop_at_third)
    try:
        with pytest.raises(SystemExit, match="stopped by SIGTERM"):
            study.main(cmd)
    finally:
        hook.remove()
    run = tmp_path / "runs" / "shapes-learned-seed0-e1"
    parked = tmp_path / "parked" / run.name
    with RunLock(run):  # a run still training is not copied half-way
        assert study.main(["--park", "--out", str(tmp_path), "--park-dir", str(tmp_path / "parked")]) == 0
    assert "is in use by process" in capsys.readouterr().out and not parked.exists()
    assert study.main(["--park", "--out", str(tmp_path), "--park-dir", str(tmp_path / "parked")]) == 0
    assert "1 run parked" in capsys.readouterr().out
    assert {p.name for p in parked.iterdir()} == {"checkpoint.pt", "config.yaml"}  # stopped in its first epoch: no metrics yet
    assert (load_checkpoint(parked)["epoch"], load_checkpoint(parked)["step"]) == (0, 3)
    assert not unpark_run(parked, run)  # the run got as far on this machine: nothing brought back over it
    shutil.rmtree(tmp_path / "runs")  # the next machine: a fresh clone with the parked copy, no runs
    assert study.main(cmd) == 0
    out = capsys.readouterr().out
    assert "brought back from" in out and "at epoch 1, step 3/8" in out and "its parked copy" in out
    assert not parked.exists() and load_checkpoint(run)["epoch"] == 1
    assert {r["row"] for r in study.load_results(tmp_path)} == {"learned"}
    assert study.main(["--park", "--out", str(tmp_path), "--park-dir", str(tmp_path / "parked")]) == 0  # a finished, evaluated run stays where it is
    assert "0 runs parked" in capsys.readouterr().out and not parked.exists()
    # Stopped between its last epoch and its evaluation: the run is finished but results.csv does not hold it. It is
    # parked too, and the next machine evaluates it rather than training it again.
    (tmp_path / "results.csv").unlink()
    assert study.main(["--park", "--out", str(tmp_path), "--park-dir", str(tmp_path / "parked")]) == 0
    assert "1 run parked" in capsys.readouterr().out and load_checkpoint(parked)["epoch"] == 1
    shutil.rmtree(tmp_path / "runs")
    assert study.main(cmd) == 0
    out = capsys.readouterr().out
    assert "brought back from" in out and "reusing finished run" in out and "resuming" not in out
    assert not parked.exists() and {r["row"] for r in study.load_results(tmp_path)} == {"learned"}
    with pytest.raises(SystemExit, match="is inside the repository: park runs outside it"):
        study.main(["--park", "--out", str(tmp_path), "--park-dir", str(ROOT / "docs" / "parked")])


def test_resolution_transfer_starts_a_seed_where_the_rows_other_seeds_or_its_plain_family_needed_to_go(tmp_path):
    study = load_benchmark("resolution_transfer")
    runs = tmp_path / "runs"
    assert study.first_epochs(runs, "shapes", "fire", 24, 48) == 24  # nothing trained yet: the recipe's epochs
    for name in ("shapes-fire-seed0-e24", "shapes-fire-seed0-e48", "shapes-fire_aug-seed1-e96",
                 "shapes-sincos2d_multires-seed0-e48", "fashion_mnist-fire-seed0-e96", "shapes-fire-seed0-e12.bak",
                 "shapes-lookhere-seed0-e48", "shapes-lookhere_aug-seed0-e24"):
        (runs / name).mkdir(parents=True)
    assert study.first_epochs(runs, "shapes", "fire", 24, 48) == 48  # seed 0 needed 48: seed 1 starts there
    assert study.first_epochs(runs, "shapes", "fire", 24, 32) == 32  # never past --max-epochs
    assert study.first_epochs(runs, "shapes", "sincos2d:multires", 24, 48) == 48
    assert study.first_epochs(runs, "shapes", "sincos2d", 24, 48) == 24  # another row's runs do not count
    assert study.first_epochs(runs, "shapes", "fire:aug", 24, 48) == 48
    # A variant row with no seed trained yet starts where its plain family needed to go; once it has seeds, theirs.
    assert study.first_epochs(runs, "shapes", "fire:multires", 24, 48) == 48
    assert study.first_epochs(runs, "shapes", "rope_axial:multires", 24, 48) == 24  # plain row not trained: the recipe's
    assert study.first_epochs(runs, "shapes", "lookhere:aug", 24, 48) == 24
    # A fresh clone has no run directories (git-ignored), only the committed measurements: they say it too.
    recorded = [{"data": "shapes", "row": "learned", "seed": 0, "epochs": 48},
                {"data": "fashion_mnist", "row": "cpb", "seed": 0, "epochs": 96}]
    assert study.first_epochs(tmp_path / "fresh", "shapes", "learned", 24, 48, recorded) == 48
    assert study.first_epochs(tmp_path / "fresh", "shapes", "cpb", 24, 48, recorded) == 24  # another dataset's do not count
    assert study.first_epochs(tmp_path / "fresh", "shapes", "learned:aug", 24, 48, recorded) == 48
    # A run still moving is entered in runs.jsonl when it is trained again longer, so its seed's retraining starts there.
    for _ in range(2):
        study.record_run(tmp_path, {"data": "shapes", "row": "peg", "seed": 0, "epochs": 24, "retrained_with": 48})
    assert len(study.load_trained(tmp_path)) == 1  # once, however often the study passes by
    assert study.first_epochs(tmp_path / "fresh", "shapes", "peg", 24, 48, study.load_trained(tmp_path)) == 48


def test_resolution_transfer_grid_draws_per_batch_where_a_draw_per_image_is_unaffordable():
    study = load_benchmark("resolution_transfer")
    coordinate_families = [pe for pe in vitpe.list_pos_embeds() if pe not in study.NO_COORDS]
    rows = study.all_rows()
    assert len(rows) == len(set(rows))
    assert {r.partition(":")[0] for r in rows if r.endswith(":aug")} == set(coordinate_families) - {"liere", "comrope"}
    assert {r.partition(":")[0] for r in rows if r.endswith(":augbatch")} == {"liere", "comrope", "rope_axial"}  # and the control
    assert {r for r in rows if ":" not in r} == {r.partition(":")[0] for r in rows if r.endswith(":multires")} == set(vitpe.list_pos_embeds())
    assert study.parse_row("liere:aug") == ("liere", "aug")  # out of the grid, still there to ask for
    for bad in ("none:augbatch", "peg:aug", "rope_axial:batch"):
        with pytest.raises(SystemExit, match="unknown study row"):
            study.parse_row(bad)
    args = argparse.Namespace(config=None, set=[])
    per_batch = study.train_args("shapes", "liere:augbatch", 0, args).overrides
    per_image = study.train_args("shapes", "rope_axial:aug", 0, args).overrides
    assert "model.coord_aug={shift: 1.0, rescale: 2.0, jitter: 1.25, per_image: false}" in per_batch
    assert "model.coord_aug={shift: 1.0, rescale: 2.0, jitter: 1.25}" in per_image


def test_resolution_transfer_trains_a_per_batch_row(tmp_path, capsys):
    study = load_benchmark("resolution_transfer")
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "comrope:augbatch", "--max-epochs", "1"]) == 0
    [entry] = study.load_trained(tmp_path)
    assert entry["row"] == "comrope:augbatch" and entry["config"]["model"]["coord_aug"] == {
        "shift": 1.0, "rescale": 2.0, "jitter": 1.25, "per_image": False}
    rows = study.load_results(tmp_path)
    assert {r["variant"] for r in rows} == {"augbatch"} and all(0 <= r["top1"] <= 1 for r in rows)
    assert "| comrope:augbatch |" in (tmp_path / "table.md").read_text()


def test_resolution_transfer_orderings_weigh_the_seed_spread_and_convergence(tmp_path):
    study = load_benchmark("resolution_transfer")
    # A misspelt row would read "not measured yet" forever: every ordering names rows the study can train.
    for better, worse, _, _ in study.ORDERINGS:
        assert study.parse_row(better) and study.parse_row(worse)

    def measured(row, converged, top1_1x, top1_2x, seed=0, mode="interpolate"):
        return [{"data": "shapes", "row": row, "pe": row, "variant": "", "seed": seed, "train_size": 32, "epochs": 24,
                 "converged": converged, "train_wall_s": 60.0, "label": mode, "route": "coords",
                 "coord_mode": mode, "rope_scaling": "none", "column": c, "scale": k, "height": 32 * k,
                 "width": 32 * k, "top1": t, "tokens_per_image": 64 * k * k} for c, k, t in (("1x", 1, top1_1x), ("2x", 2, top1_2x))]

    def ordering(rows):
        study.report(rows, tmp_path)
        return next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("- Swin-V2"))

    assert ordering(measured("cpb", True, 0.99, 0.76) + measured("rel_bias", False, 0.85, 0.60)).endswith(
        "cpb -23.0 (1 seed) vs rel_bias -25.0 (1 seed) at 2x: confirmed on one seed each (the spread between seeds is "
        "not known); provisional: rel_bias had not converged")
    # Three seeds each, 2.0 points apart on average, but with standard deviations of 6.0 and 8.7 points: no ranking.
    spread = [r for s, (a, b) in enumerate(((0.76, 0.79), (0.70, 0.64), (0.82, 0.79))) for r in
              measured("cpb", True, 0.99, a, s) + measured("rel_bias", True, 0.99, b, s)]
    assert ordering(spread).endswith("cpb -23.0 (3 seeds) vs rel_bias -25.0 (3 seeds) at 2x: not separated (a difference "
                                     "of 2.0 against twice its standard error over seeds, 12.2)")
    # The same means from tight seeds rank them; a row with one seed borrows the other's spread.
    tight = [r for s, (a, b) in enumerate(((0.76, 0.74), (0.75, 0.73), (0.77, 0.75))) for r in
             measured("cpb", True, 0.99, a, s) + measured("rel_bias", True, 0.99, b, s)]
    assert ordering(tight).endswith("at 2x: confirmed")
    assert ordering([r for r in tight if r["row"] == "cpb"] + measured("rel_bias", True, 0.99, 0.60)).endswith(
        "rel_bias -39.0 (1 seed) at 2x: confirmed (rel_bias: one seed, its spread taken as the other row's)")
    # Extrapolate mode, where both rows were measured in it, gets its own verdict under the interpolate one.
    both = tight + [r for s, (a, b) in enumerate(((0.30, 0.50), (0.32, 0.52), (0.31, 0.51))) for r in
                    measured("cpb", True, 0.99, a, s, "extrapolate") + measured("rel_bias", True, 0.99, b, s, "extrapolate")]
    for rows, after in ((both, "  - extrapolate mode: cpb -68.0 (3 seeds) vs rel_bias -48.0 (3 seeds) at 2x: contradicted"),
                        (tight, "- RoPE-ViT: RoPE-Mixed transfers better than learned APE: not measured yet")):
        swin = ordering(rows)
        lines = (tmp_path / "table.md").read_text().splitlines()
        assert lines[lines.index(swin) + 1] == after


def test_canvas_smoke(tmp_path, capsys):
    canvas = load_benchmark("canvas")
    assert canvas.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "canvas.json").read_text())
    assert [r["margin_patches"] for r in rows] == [0, 1] and [r["px"] for r in rows] == [16, 24]
    # No margin: the canvas is the native image on the trained grid, and the temperature is exactly 1.
    r0 = rows[0]
    assert r0["canvas"] == r0["canvas_scene_pool"] == r0["canvas_scene_keys"] == r0["native"] == r0["canvas_logn"] == r0["native_logn"]
    assert "| rope_axial | 1 | 24 | 36 |" in (tmp_path / "canvas.md").read_text()
    # Measuring again replaces the run's rows instead of adding to them.
    assert canvas.main([rows[0]["run"], "--margins", "1", "--n", "8", "--out", str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "canvas.json").read_text())) == 2
    capsys.readouterr()
    assert canvas.main([rows[0]["run"], "--margins", "1", "--n", "8", "--out", str(tmp_path)]) == 0
    assert "already measured" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="nowhere does not exist; give a run directory"):
        canvas.main([str(tmp_path / "nowhere"), "--out", str(tmp_path)])


def test_attention_override_scales_and_restricts_attention():
    canvas = load_benchmark("canvas")
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 40, 8).unbind(0)  # (B, H, T, hd): 40 keys

    def expected(factor, keys=slice(None)):
        attn = torch.softmax(q @ k[..., keys, :].transpose(-1, -2) * factor / 8 ** 0.5, -1)
        return (attn @ v[..., keys, :]).transpose(1, 2).reshape(1, 40, 16)

    for train_keys, factor in ((40, 1.0), (10, math.log(40) / math.log(10))):
        with canvas.attention_override(train_keys):
            assert torch.allclose(vitpe.vit.attend(q, k, v, None, 0), expected(factor), atol=1e-5)
    assert not torch.allclose(vitpe.vit.attend(q, k, v, None, 0), expected(math.log(40) / math.log(10)), atol=1e-3)
    # The mask is over the patch tokens; the leading tokens not covered by it (a class token here) are always kept.
    scene = torch.zeros(39, dtype=torch.bool)
    scene[10:20] = True
    with canvas.attention_override(keys=scene):
        out = vitpe.vit.attend(q, k, v, None, 0)
    assert torch.allclose(out, expected(1.0, [0] + list(range(11, 21))), atol=1e-5)


def test_shapes_leak_smoke(tmp_path):
    leak = load_benchmark("shapes_leak")
    assert leak.main(["--smoke", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "shapes_leak.json").read_text())
    # Without a PE the model is a bag of patches: shuffling them moves its logits by float rounding only.
    assert r["pos_embed"] == "none" and r["max_logit_change_by_shuffling"] < 1e-3 and r["unchanged_by_shuffling"] > 0.95
    assert sum(b["n"] for b in r["bins"]) == r["arrangement_n"] > 0 and "| play along" in (tmp_path / "shapes_leak.md").read_text()
    with pytest.raises(SystemExit, match="nowhere does not exist; give a run directory"):
        leak.main([str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no checkpoint.pt in run directory .*empty"):
        leak.main([str(tmp_path / "empty")])


def test_scale_probe_takes_positions_grid_and_content_apart(tmp_path):
    probe = load_benchmark("scale_probe")
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="learned").eval()
    # Coarsening the 2x grid's coordinates by 2 gives the 1x grid's, each over its 2x2 block (interpolate mode).
    fine, coarse = model.patch_grid((8, 8), torch.device("cpu")), model.patch_grid((4, 4), torch.device("cpu"))
    blocks = coarse.coords.reshape(4, 1, 4, 1, 2).expand(-1, 2, -1, 2, -1).reshape(64, 2)
    assert torch.allclose(probe.coarsened(fine, 2).coords, blocks, atol=1e-6) and probe.coarsened(fine, 2).key is None
    assert torch.equal(probe.coarsened(fine, 2).extent(), fine.extent())  # FIRE's normaliser: the image's, not the span's
    # The bias families read the coarsened positions (the probe once gave fire and lookhere the 2x lattice's bias, since a
    # grid that kept its mode was read as that mode's lattice): their bias is the 1x grid's, repeated over the blocks.
    for family in ("fire", "lookhere", "alibi2d", "rel_bias", "cpb"):
        pe = vitpe.build_pos_embed(family, dim=32, num_heads=2, ref_grid=(4, 4)).eval()
        with torch.no_grad():
            got, at_1x = pe.bias(probe.coarsened(fine, 2)), pe.bias(coarse)
        at_1x = at_1x.reshape(*at_1x.shape[:-2], 4, 1, 4, 1, 4, 1, 4, 1).expand(*at_1x.shape[:-2], 4, 2, 4, 2, 4, 2, 4, 2)
        assert torch.allclose(got, at_1x.reshape(got.shape), atol=1e-5), family
        assert not torch.allclose(got, pe.bias(fine), atol=1e-3), family
    with pytest.raises(ValueError, match="needs coordinates in reference patches"):
        probe.coarsened(model.patch_grid((8, 8), torch.device("cpu")).in_mode("normalize"), 2)
    # Pooled tokens: the 2x image's grid carrying the pooled image's tokens, each repeated 2x2; the hooks go on exit.
    x = torch.randn(2, 3, 32, 32)
    with probe.pooled_tokens(model, 2):
        tokens = model.patchify(x)
    expected = model.patchify(torch.nn.functional.avg_pool2d(x, 2)).repeat_interleave(2, -2).repeat_interleave(2, -1)
    assert tokens.shape == (2, 32, 8, 8) and torch.allclose(tokens, expected)
    assert torch.equal(model.patchify(x), model.patch_embed(x))

    assert probe.main(["--smoke", "--out", str(tmp_path)]) == 0
    run = str(tmp_path / "learned")
    assert probe.main([run, "--scale", "4", "--test-size", "32", "--out", str(tmp_path)]) == 0
    assert probe.main([run, "--scale", "4", "--test-size", "32", "--out", str(tmp_path)]) == 0  # replaces its own entry
    results = json.loads((tmp_path / "scale_probe.json").read_text())
    assert [(r["scale"], r["n"]) for r in results] == [(2, 64), (4, 32)]
    assert [c["cell"] for c in results[1]["cells"]] == ["1x", "2x", "4x", "4x, positions of the 2x grid", "4x, positions of the 1x grid",
                                                       "4x grid, 2x content", "2x, pooled 4x render"]
    assert all(0 <= c["top1"] <= 1 for r in results for c in r["cells"]) and results[1]["cells"][0]["change"] == 0
    assert "| 4x grid, 2x content |" in (tmp_path / "scale_probe.md").read_text()
    # Where the images go: the counts are the evaluation's (diagonal = its hits), and a class read as another is named.
    images, labels = torch.randint(0, 256, (40, 3, 16, 16), dtype=torch.uint8), torch.arange(40) % 3
    res = probe.evaluate(model, images, labels, (0.5,) * 3, (0.25,) * 3, batch_size=16, confusion=True)
    counts = torch.tensor(res["confusion"])
    assert counts.sum() == 40 and counts.sum(1).tolist() == [14, 13, 13] and counts.trace().item() == round(res["top1"] * 40)
    assert "confusion" not in probe.evaluate(model, images, labels, (0.5,) * 3, (0.25,) * 3)  # only when asked
    one, big = torch.tensor([[9, 1, 0], [0, 10, 0], [0, 0, 10]]), torch.tensor([[9, 1, 0], [0, 2, 8], [0, 0, 10]])
    assert probe.shifts(one, big, ("a", "b", "c")) == [{"class": "b", "top1_1x": 1.0, "top1_sx": 0.2, "goes_to": "c", "share": 0.8}]
    with pytest.raises(SystemExit, match="--scale 1: .* an integer of 2 or more"):
        probe.main([run, "--scale", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="nowhere does not exist; give a run directory"):
        probe.main([str(tmp_path / "nowhere"), "--out", str(tmp_path)])


def test_speed_smoke(tmp_path):
    assert load_benchmark("speed").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    steps = {r["step"] for r in rows}
    assert {"train", "inference", "train (PE cost)", "matmul peak", "data loading"} <= steps
    assert all(r["ratio_vitpe_over_timm"] > 0 and r["vitpe_peak_mib"] > 0 and r["timm_peak_mib"] > 0 for r in rows if "ratio_vitpe_over_timm" in r)
    md = (tmp_path / "speed.md").read_text()
    assert "| rope_mixed |" in md and "matmul peak" in md and "data loading" in md
    assert {r["pe"] for r in rows if "pe" in r} == set(vitpe.list_pos_embeds()) | {"sincos2d+rope_mixed"}  # every family's cost
    assert load_benchmark("speed").main(["--smoke", "--part", "pe-cost", "--out", str(tmp_path / "pe")]) == 0
    only = json.loads((tmp_path / "pe" / "pe_cost.json").read_text())["rows"]
    assert {r["step"] for r in only} == {"train (PE cost)"} and "| liere |" in (tmp_path / "pe" / "pe_cost.md").read_text()


def test_bias_mask_benchmark_compares_the_two_layouts_on_the_same_bias(tmp_path):
    speed = load_benchmark("speed")
    assert speed.main(["--smoke", "--part", "bias-mask", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bias_mask.json").read_text())["rows"]
    assert {r["pe"] for r in rows} == {"-"} | {n for n in vitpe.list_pos_embeds() if vitpe.pos_embed_info(n)["biased"]}  # the registry's
    assert all(r["speedup"] > 0 and r["img_s_3d"] > 0 and r["img_s_4d"] > 0 for r in rows)
    assert "| inference | fire | 32 (64) |" in (tmp_path / "bias_mask.md").read_text()
    # The 3-D side really gives SDPA a 3-D mask, and the same attention: only the layout differs.
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="fire").eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = model(x)
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention",
                               lambda q, k, v, attn_mask=None, **kw: seen.append(attn_mask.dim()) or sdpa(q, k, v, attn_mask=attn_mask, **kw)):
            with speed.bias_mask_as_3d():
                out = model(x)
    assert seen == [3]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_resolution_transfer_trains_each_dataset_up_to_its_protocols_cap(tmp_path, monkeypatch):
    """shapes doubles a run still moving up to 48 epochs; Fashion-MNIST trains every row once, at its recipe's 8
    (DOUBLINGS); --max-epochs lifts the cap, and a row's next seed then starts where its other seeds went."""
    study = load_benchmark("resolution_transfer")
    trained = []

    def train(run, args, label):
        trained.append(run.name)
        return run

    def still_moving(run):  # every run's test top-1 still rising a point per epoch
        epochs = int(run.name.rpartition("-e")[2])
        return {"metrics": [{"test_top1": 0.5 + 0.01 * e, "wall_s": float(e), "epoch_s": 1.0} for e in range(epochs)]}

    args = argparse.Namespace(max_epochs=None, config=None, set=[])
    monkeypatch.setattr(study, "train_or_reuse", train)
    monkeypatch.setattr(study, "load_checkpoint", still_moving)
    monkeypatch.setattr(study, "checkpoint_config", lambda state: study.study_config("shapes", args))
    runs = tmp_path / "runs"
    study.train_converged("fashion_mnist", "sincos2d", 0, args, runs, [])
    assert trained == ["fashion_mnist-sincos2d-seed0-e8"]
    study.train_converged("shapes", "sincos2d", 0, args, runs, [])
    assert trained[1:] == ["shapes-sincos2d-seed0-e24", "shapes-sincos2d-seed0-e48"]
    args.max_epochs = 48
    seed0 = [{"data": "fashion_mnist", "row": "sincos2d:multires", "seed": 0, "epochs": 48}]
    study.train_converged("fashion_mnist", "sincos2d:multires", 1, args, runs, seed0)
    assert trained[3:] == ["fashion_mnist-sincos2d_multires-seed1-e48"]
    assert {(e["data"], e["seed"], e["epochs"], e.get("retrained_with")) for e in study.load_trained(tmp_path)} == {
        ("fashion_mnist", 0, 8, None), ("shapes", 0, 24, 48), ("shapes", 0, 48, None), ("fashion_mnist", 1, 48, None)}
    # The cap follows the recipe as the study runs it: --set train.epochs=12 on shapes doubles 12 -> 24, no further.
    args.max_epochs, args.set = None, ["train.epochs=12"]
    study.train_converged("shapes", "rope_axial", 0, args, runs, [])
    assert trained[4:] == ["shapes-rope_axial-seed0-e12", "shapes-rope_axial-seed0-e24"]


def test_resolution_transfer_refuses_a_cap_below_one_epoch(capsys):
    with pytest.raises(SystemExit):
        load_benchmark("resolution_transfer").main(["--max-epochs", "0"])
    assert "--max-epochs must be at least 1" in capsys.readouterr().err


def test_accuracy_smoke(tmp_path):
    assert load_benchmark("accuracy").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert {(r["pe"], r["seed"]) for r in rows} == {("none", 0), ("none", 1), ("rope_mixed", 0), ("rope_mixed", 1)}
    assert all(0 <= r["top1"] <= 1 and r["params"] > 0 and r["train_wall_s"] > 0 for r in rows)
    table = (tmp_path / "pe_table.md").read_text()
    assert "| rope_mixed |" in table and "±" in table and (tmp_path / "pe_table.png").stat().st_size > 5000
    assert (tmp_path / "accuracy.csv").read_text().count("\n") == 5
    # Seeds differ (different runs), and a second invocation reuses the finished runs instead of retraining.
    assert len({r["run"] for r in rows}) == 4
    assert load_benchmark("accuracy").main(["--smoke", "--out", str(tmp_path), "--pes", "none"]) == 0
    assert len(json.loads((tmp_path / "accuracy.json").read_text())) == 4
    # Other settings make other runs: an override never silently reuses a run trained without it.
    assert load_benchmark("accuracy").main(["--smoke", "--out", str(tmp_path), "--pes", "none", "--set", "train.lr=0.01"]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert len(rows) == 6 and sum(r["recipe"]["train"]["lr"] == 0.01 for r in rows) == 2


def test_per_image_smoke(tmp_path):
    assert load_benchmark("per_image").main(["--smoke", "--parts", "token_keep", "packing", "coord_aug", "lattice", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "per_image.json").read_text())
    aug = data["coord_aug"][0]  # the study's own augmentation, timed against the same PE without it and against none
    assert aug["pe"] == "rope_axial" and json.loads(aug["coord_aug"]) == {"shift": 1.0, "rescale": 2.0, "jitter": 1.25}
    assert aug["aug_img_s"] > 0 and aug["aug_over_pe"] > 0
    assert aug["per_batch_over_pe_min"] <= aug["per_batch_over_pe"] <= aug["per_batch_over_pe_max"]  # its study row also draws per batch
    lattice = data["lattice"][0]  # packed rows of several images each, lattice path against every pair
    assert lattice["pe"] == "fire" and lattice["images_per_row"] > 1 and lattice["speedup"] > 0
    keeps = {(r["arch"], r["token_keep"]) for r in data["token_keep"]}
    assert len(keeps) == 6 and all(r["img_s"] > 0 for r in data["token_keep"])  # three architectures, r = 1 and 0.5
    assert {r["setup"] for r in data["packing"]} == {"16-48 px, rows of 144 tokens", "16-32 px, rows of 64 tokens", "16-32 px, rows of 128 tokens"}
    assert all(0 < r["fill"] <= 1 for r in data["packing"])
    assert "### packing" in (tmp_path / "per_image.md").read_text()


def test_per_image_coord_aug_times_every_family_the_study_augments():
    import vitpe

    # The cost column of docs/which_pe.md's "+ coord_aug" rows comes from this part: by default it times each of them.
    pes = load_benchmark("per_image").study_aug_pes()
    assert set(pes) == set(vitpe.list_pos_embeds()) - {"none", "peg"} and len(pes) == len(set(pes))


def test_cpu_levers_smoke(tmp_path):
    # compile is left out: its first step compiles for seconds; the part runs in the hand-run benchmark
    assert load_benchmark("cpu_levers").main(["--smoke", "--out", str(tmp_path), "--parts", "bf16", "adamw", "profile", "--arch", "main"]) == 0
    rows = json.loads((tmp_path / "cpu_levers.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["bf16", "adamw", "profile"]
    prof = rows[-1]
    # Two timings taken at different moments: beside other work their ratio can read above 1, so only its definition is checked.
    assert prof["fraction_of_peak"] > 0 and abs(prof["fraction_of_peak"] - prof["tflop_s"] / prof["fp32_matmul_peak_tflop_s"]) < 1e-9
    assert abs(sum(prof["share_by_kind"].values()) - 1) < 1e-6
    assert rows[0]["ratio_bf16_over_fp32"] > 0 and rows[1]["foreach_img_s"] > 0
    assert "of the fp32 matmul peak" in (tmp_path / "cpu_levers.md").read_text()
    # One part measured again alone (here threads, in worker processes) adds its rows and keeps the others'.
    assert load_benchmark("cpu_levers").main(["--smoke", "--out", str(tmp_path), "--parts", "threads", "--arch", "main"]) == 0
    again = json.loads((tmp_path / "cpu_levers.json").read_text())["rows"]
    assert [r["part"] for r in again] == ["bf16", "adamw", "profile", "threads"] and again[:3] == rows
    threads = again[-1]
    assert threads["cores"] >= 1 and threads["one_process_img_s"] > 0 and threads["per_core_img_s"] > 0
    assert threads["ratio_per_core_over_one_process"] == pytest.approx(threads["per_core_img_s"] / threads["one_process_img_s"])
    assert "torch " + torch.__version__ in threads["measured"] and "per core / one process" in (tmp_path / "cpu_levers.md").read_text()
    assert load_benchmark("cpu_levers").main(["--smoke", "--out", str(tmp_path / "c"), "--parts", "content", "--arch", "fmnist"]) == 0
    row = json.loads((tmp_path / "c" / "cpu_levers.json").read_text())["rows"][0]
    assert row["keep0.5_img_s"] > 0 and row["ratio_keep0.65_over_keep1"] > 0


def test_main_suite_records_its_results_and_a_later_run_of_the_recipe_compares_itself(tmp_path, capsys, monkeypatch):
    from vitpe import training

    reference = tmp_path / "reference.json"
    assert load_benchmark("accuracy").main(["--smoke", "--suite", "main", "--out", str(tmp_path), "--reference", str(reference)]) == 0
    entries = json.loads(reference.read_text())
    assert len(entries) == 1 and set(entries[0]["results"]) == {"none", "rope_mixed"}
    none = entries[0]["results"]["none"]
    assert none["seeds"] == [0, 1] and len(none["top1"]) == len(none["position_top1"]) == 2
    assert "main job, pe=none" in capsys.readouterr().out
    # A new run of that recipe with another PE and seed ends with the measured comparison; another recipe does not.
    monkeypatch.setattr(training, "REFERENCE_FILE", reference)
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert training.train(tiny, ["train.epochs=1", "model.pos_embed=sincos2d", "train.seed=5", f"out_dir={tmp_path}", "name=later"]) == 0
    out = capsys.readouterr().out
    assert "learned: " in out and f"without a PE (pos_embed=none) the same recipe reached {100 * sum(none['top1']) / 2:.1f}%" in out
    assert training.train(tiny, ["train.epochs=2", f"out_dir={tmp_path}", "name=other"]) == 0
    assert "without a PE" not in capsys.readouterr().out


def test_resolution_transfer_counts_the_training_time_of_every_process_of_a_resumed_run():
    study = load_benchmark("resolution_transfer")
    def metrics(*walls):
        return [{"test_top1": 0.5, "wall_s": w, "epoch_s": 40.0} for w in walls]

    assert study.training_time(metrics(50.0, 100.0, 160.0)) == 160.0  # vitpe now: wall_s counts across resumes
    # Older runs restarted wall_s at each resume, also where the first epoch after it ran longer than the one before
    restarted = metrics(50.0, 100.0, 20.0, 70.0, 75.0, 130.0)  # resumed at 20 and at 75 (grown by less than its epoch)
    assert study.training_time(restarted) == 100.0 + 20.0 + 70.0 + 130.0  # resumed at 20: 40 - 20 of it ran before the stop
    assert study.convergence(restarted)["train_time_s"] == 320.0 and study.convergence(restarted)["train_wall_s"] == 130.0
    assert study.training_time(metrics(15.0, 60.0)) == 25.0 + 60.0  # stopped in its first epoch: 25 s before the stop


def test_reliability_campaign_kills_resumes_and_keeps_an_earlier_campaign(tmp_path):
    """About a minute of real signals (benchmarks/reliability.py): kill -9, Ctrl-C and SIGTERM each stop a real
    train.py, which resumes to weights equal to an uninterrupted run's; a campaign of other epochs is refused, not replaced."""
    campaign = load_benchmark("reliability")
    assert campaign.main(["--smoke", "--trials", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "campaign.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == list(campaign.SIGNALS)
    for r in rows:
        assert r["intact"] and r["bit_exact"] and r["resume_returncode"] == 0 and r["leftover_temporaries"] == 0, r
    assert "| SIGTERM | 1 |" in (tmp_path / "campaign.md").read_text()
    before = (tmp_path / "campaign.json").read_text()
    with pytest.raises(SystemExit, match=r"holds a campaign with --epochs 1 \(3 trials\): continue it with --epochs 1"):
        campaign.main(["--epochs", "12", "--out", str(tmp_path)])
    assert (tmp_path / "campaign.json").read_text() == before


def test_studykit_sdpa_override_reaches_vitpe_and_equipped_timm_attention_and_restores():
    """What the override returns is the attention's output, on vitpe's blocks and on a timm ViT equipped with a vitpe
    PE; nested overrides restore the outer one; an override that reaches no attention, or whose body fails, leaves
    SDPA as it was, the first with a clear error."""
    import timm

    kit = load_benchmark("studykit")
    sdpa = torch.nn.functional.scaled_dot_product_attention
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed="cpb").eval()
    t = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=3).eval()
    vitpe.equip_timm_vit(t, "rope_mixed")
    x = torch.randn(2, 3, 16, 16)
    hot = lambda q, k, v, **kw: sdpa(q, k, v, **{**kw, "scale": 2.0})  # noqa: E731 (sharper attention)
    with torch.no_grad():
        before = model(x)
        for m, xs in ((model, x), (t, torch.randn(2, 3, 32, 32))):
            ref = m(xs)
            with kit.sdpa_override(lambda q, k, v, **kw: sdpa(q, k, v, **kw)) as calls:
                torch.testing.assert_close(m(xs), ref)  # the same kernel inputs: the same output
            assert len(calls) == len(m.blocks)
            with kit.sdpa_override(hot) as calls:
                assert not torch.allclose(m(xs), ref, atol=1e-3)
        with kit.sdpa_override(hot) as outer:
            with kit.sdpa_override(lambda *a, **kw: sdpa(*a, **kw)) as inner:
                model(x)
            model(x)
        assert (len(inner), len(outer)) == (2, 2)
        with pytest.raises(RuntimeError, match="never reached the attention"):
            with kit.sdpa_override(hot):
                pass
        with pytest.raises(ZeroDivisionError):
            with kit.sdpa_override(hot):
                1 / 0
        torch.testing.assert_close(model(x), before)  # plain SDPA again
    assert torch.nn.functional.scaled_dot_product_attention is sdpa


def test_field_transfer_smoke(tmp_path):
    """The study of issue 87 in seconds: every row trains once with each recipe (the field's adds RandomResizedCrop and a
    per-batch coordinate draw), is measured on the coordinate routes, the patch route and the resize baseline, lands in
    the record and the table, and is kept, not trained again, on a second pass."""
    study = load_benchmark("field_transfer")
    assert study.main(["--smoke", "--out", str(tmp_path), "--families", "sincos2d", "none"]) == 0
    rows = study.load_results(tmp_path)
    assert {(r["pos_embed"], r["recipe"]) for r in rows} == {(f, r) for f in ("sincos2d", "none") for r in ("plain", "crops", "field")}
    sincos = [r for r in rows if r["pos_embed"] == "sincos2d" and r["recipe"] == "plain"]
    assert {(r["route"], r["coord_mode"]) for r in sincos} == {("coords", "interpolate"), ("coords", "extrapolate"),
                                                               ("patch", "interpolate"), ("resize", "interpolate")}
    assert {r["coord_mode"] for r in rows if r["pos_embed"] == "none"} == {"interpolate"}  # it reads no coordinates
    assert {r["scale"] for r in sincos if r["route"] == "resize"} == {0.5, 0.75, 1.5, 2.0, 3.0, 4.0}
    field = study.run_args("gratings", "sincos2d", "field", 0, 8, None, []).overrides
    assert "data.crop_scale=[0.25, 1.0]" in field and any(a.startswith("model.coord_aug=") for a in field)
    assert not any(a.startswith("model.coord_aug=") for a in study.run_args("gratings", "none", "field", 0, 8, None, []).overrides)
    crops = study.run_args("gratings", "sincos2d", "crops", 0, 8, None, []).overrides  # the crops alone: their effect apart from the coordinates'
    assert "data.crop_scale=[0.25, 1.0]" in crops and not any(a.startswith("model.coord_aug=") for a in crops)
    table = (tmp_path / "table.md").read_text()
    assert "| sincos2d | field | 1 |" in table and "| none | plain | 1 |" in table
    assert study.main(["--smoke", "--out", str(tmp_path), "--families", "sincos2d", "none"]) == 0
    assert [str(r) for r in study.load_results(tmp_path)] == [str(r) for r in rows]  # (nan: a run too short for a last fifth)
    assert not (tmp_path / "gratings.png").exists()  # a study's rows rewrite the table only; the figure is --report's
    assert study.main(["--report", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "gratings.png").stat().st_size > 10_000 and (tmp_path / "table.md").read_text() == table


def test_field_transfer_reports_a_snapped_size_under_its_planned_scale(tmp_path):
    """Sizes are whole patches: Fashion-MNIST's 1.5x (42 px) is measured at 40 px (1.43x) on the coordinate and resize
    routes and at 42 on the patch route. The table shows both under 1.5x and names the sizes it measured."""
    study = load_benchmark("field_transfer")
    assert [study.nominal(s) for s in (0.5714, 0.7143, 1.0, 1.4286, 1.5, 2.0, 3.0, 4.0)] == [0.5, 0.75, 1.0, 1.5, 1.5, 2.0, 3.0, 4.0]
    base = {"data": "fashion_mnist", "pos_embed": "rope_mixed", "recipe": "field", "seed": 0, "train_size": 28}
    rows = [{**base, "route": route, "coord_mode": "interpolate", "scale": round(px / 28, 4), "height": px, "top1": top1}
            for route, px, top1 in (("coords", 28, 0.9), ("coords", 40, 0.8), ("resize", 40, 0.85), ("patch", 42, 0.88))]
    assert [round(x, 6) for x in study.changes(rows, "fashion_mnist", "rope_mixed", "field", "coords", "interpolate", 1.5)] == [-10.0]
    assert [round(x, 6) for x in study.changes(rows, "fashion_mnist", "rope_mixed", "field", "patch", "interpolate", 1.5)] == [-2.0]
    assert study.changes(rows, "fashion_mnist", "rope_mixed", "field", "coords", "interpolate", 2.0) == []
    study.report([{**r, "epochs": 8, "converged": True, "last_fifth_gain_points": 0.0, "train_time_s": 600.0} for r in rows], tmp_path)
    table = (tmp_path / "table.md").read_text()
    assert "coordinate and resize routes 28, 40; patch route 42." in table
    assert "| rope_mixed | field | 1 | 90.0 | -10.0 / - / -5.0 |" in table


def test_field_transfer_measures_only_the_scales_asked_for():
    """--scales cuts a row's evaluations to the sizes a table needs (a row's cost is mostly its largest size): every
    route at those scales and at 1x, nothing else."""
    study = load_benchmark("field_transfer")
    model = vitpe.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10)
    full = study.plan_of(model, 32, "sincos2d")
    cut = study.plan_of(model, 32, "sincos2d", [1.0, 2.0])
    assert {hw[0] for _, _, hw in full} > {hw[0] for _, _, hw in cut} == {32, 64}
    assert {(m, r) for m, r, _ in cut} == {("interpolate", "coords"), ("extrapolate", "coords"), ("interpolate", "patch"),
                                          ("interpolate", "resize")}
    with pytest.raises(SystemExit):  # a scale the tables have no column for
        study.main(["--scales", "2.5", "--report"])


def test_finetune_study_smoke(tmp_path):
    """Every arm of the fine-tuning study on tiny runs: sources first, fine-tunes from them, each arm measured at every
    size into the record; a second call finds them all recorded, and the report reads the record back."""
    study = load_benchmark("finetune_study")
    assert study.main(["--smoke", "--out", str(tmp_path), "--seeds", "0"]) == 0
    rows = study.load_results(tmp_path / "results.csv")
    assert {r["arm"] for r in rows} == set(study.ARMS)
    one = [r for r in rows if r["arm"] == "one"]
    assert {(r["route"], r["resolution"]) for r in one} == {("coords", 32), ("coords", 48), ("coords", 64), ("patch", 48), ("patch", 64),
                                                             ("resize", 48), ("resize", 64)}
    ft = [r for r in rows if r["arm"] == "ft64"]
    assert all(r["source_time_s"] > 0 and r["steps"] == 4 for r in ft) and len(ft) == 3
    assert load_checkpoint(tmp_path / "runs" / "shapes-ft64-seed0")["config"]["model"]["img_size"] == 64
    assert load_checkpoint(tmp_path / "runs" / "shapes-ft64keep-seed0")["config"]["model"]["img_size"] == 16
    assert study.main(["--smoke", "--out", str(tmp_path), "--seeds", "0"]) == 0  # nothing left to do
    assert "| shapes: arm (route) |" in study.table(rows, "shapes") and "| ft64 (coords) | 1 |" in study.table(rows, "shapes")


def test_routes_study_smoke(tmp_path):
    """The routes study on tiny runs: multi and one trained first, the fine-tunes from one, each measured by its routes
    into the record; a second call trains nothing; the table shows absolute top-1 at every size with retention."""
    study = load_benchmark("routes")
    assert study.main(["--smoke", "--out", str(tmp_path), "--seeds", "0"]) == 0
    rows = study.load_results(tmp_path / "results.csv")
    assert {r["arm"] for r in rows} == set(study.ARMS)
    one = {(r["route"], r["resolution"]) for r in rows if r["arm"] == "one"}
    assert {("coords", s) for s in study.SIZES} <= one and {("resize", 64), ("resize", 128), ("resize", 16)} <= one
    assert {(r["route"], r["resolution"]) for r in rows if r["arm"] == "ft48"} == {("coords", 32), ("coords", 48)}
    assert all(r["source_time_s"] > 0 for r in rows if r["arm"].startswith("ft"))
    assert load_checkpoint(tmp_path / "runs" / "shapes-ft48-seed0")["config"]["train"]["resolutions"] == [48]
    assert study.main(["--smoke", "--out", str(tmp_path), "--seeds", "0"]) == 0  # nothing left to do
    table = study.table(rows, "shapes")
    assert "| trained at 16-48 px (multi), coordinates | 1 |" in table and "| one, then fine-tuned at the size" in table
    assert "4x (128 px) | retention 2x | retention 4x |" in table


def test_convergence_is_a_flat_trend_not_a_fall_or_one_last_epoch():
    """A run converged when the least-squares trend of its last fifth of epochs is under 0.3 points either way: a fall
    is a run still moving, and one noisy last epoch does not decide it."""
    kit = load_benchmark("studykit")

    def verdict(top1):
        return kit.convergence([{"test_top1": t, "wall_s": 1.0, "epoch_s": 1.0} for t in top1])

    flat = [0.5, 0.8, 0.9, 0.95, 0.951, 0.952, 0.951, 0.952, 0.951, 0.952]
    assert verdict(flat)["converged"]
    assert not verdict([0.5, 0.8, 0.9, 0.95, 0.96, 0.96, 0.95, 0.94, 0.93, 0.92])["converged"]  # falling: not settled
    assert not verdict([0.5, 0.6, 0.7, 0.8, 0.85, 0.88, 0.9, 0.92, 0.94, 0.96])["converged"]  # rising
    assert verdict(flat[:-1] + [0.949])["converged"]  # one epoch a little down is noise on a flat trend
    assert verdict([0.5, 0.9])["last_fifth_gain_points"] != verdict([0.5, 0.9])["last_fifth_gain_points"]  # too short: nan


def test_finetune_study_small_data_smoke(tmp_path):
    """The small-data part on tiny runs: the two image folders written once (other classes in each), the source
    trained on the first, every arm on the second from it or from scratch with the arm's recipe, each measured on its
    folder's test images into the record, which the report reads back."""
    study = load_benchmark("finetune_study")
    assert study.main(["--smoke", "--data", "fashion", "--out", str(tmp_path), "--seeds", "0", "--shard", "0/1"]) == 0
    pre, small = ({p.name for p in (tmp_path / name / "train").iterdir()} for name in ("fashion-pre", "fashion-small"))
    assert len(pre) == len(small) == 5 and not pre & small
    assert len(list((tmp_path / "fashion-small" / "train" / "Bag").iterdir())) == 24
    rows = study.load_results(tmp_path / "results.csv")
    assert sorted(r["arm"] for r in rows) == sorted(study.TRANSFER_ARMS) and {r["resolution"] for r in rows} == {16}
    cfg = {arm: load_checkpoint(tmp_path / "runs" / f"fashion-{arm}-seed0")["config"] for arm in study.TRANSFER_ARMS}
    assert cfg["probe"]["train"]["freeze"] == "backbone" and cfg["ft"]["train"]["layer_decay"] == 0.75
    assert cfg["ft-nold"]["train"]["layer_decay"] == 1.0 and cfg["ft"]["data"]["augment"] == cfg["scratch"]["data"]["augment"]
    assert cfg["ft"]["init"]["source"] == str(tmp_path / "runs" / "fashion-pretrain-seed0") and not cfg["scratch"]["init"]["source"]
    assert all(r["source_time_s"] > 0 for r in rows if r["arm"] in ("probe", "ft", "ft-nold"))
    assert all(r["source_time_s"] == 0 for r in rows if r["arm"] in ("pretrain", "scratch", "scratch-recipe"))
    table = study.transfer_table(rows)
    assert all(f"| {arm} | {study.TRANSFER_WHAT[arm]} | 1 |" in table for arm in study.TRANSFER_ARMS)
    with pytest.raises(SystemExit):  # an arm of the other part
        study.main(["--smoke", "--data", "fashion", "--out", str(tmp_path), "--arms", "ft64"])


def test_time_to_accuracy_smoke_records_each_lever_and_reuses_its_runs(tmp_path, capsys):
    study = load_benchmark("time_to_accuracy")
    rows_asked = ("main job", "schedule", "6 epochs + finish")
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", *rows_asked, "--seeds", "0"]) == 0
    rows = study.load_results(tmp_path / "results.csv")
    assert {(r["row"], r["size"]) for r in rows} == {(row, s) for row in rows_asked for s in (32, 48, 64)}
    assert all(r["amp"] in ("none", "bf16") and r["train_time_s"] > 0 for r in rows)
    assert {r["row"]: r["epochs"] for r in rows} == {"main job": 2, "schedule": 2, "6 epochs + finish": 3}
    table = (tmp_path / "table.md").read_text()
    assert "| schedule | + sizes that grow" in table and "| 1 |" in table
    schedule = load_checkpoint(tmp_path / "runs" / "main-schedule-seed0")["metrics"]
    assert [m["train_sizes"] for m in schedule] == ["8-12", "16"]  # the smoke's own schedule, recorded per epoch
    # A finish is a fine-tune of its row's run (train.py --init), and its time is both runs' time
    finish, parent = (load_checkpoint(study.run_dir(tmp_path, "main", name, 0)) for name in ("6 epochs + finish", "6 epochs"))
    assert checkpoint_config(finish).init.source == str(study.run_dir(tmp_path, "main", "6 epochs", 0))
    assert checkpoint_config(finish).train.resolutions == [16] and len(finish["metrics"]) == 1
    took = {r["row"]: r["train_time_s"] for r in rows}
    assert took["6 epochs + finish"] == pytest.approx(study.training_time(finish["metrics"]) + study.training_time(parent["metrics"]), abs=0.2)
    assert study.main(["--smoke", "--out", str(tmp_path), "--rows", "schedule", "--seeds", "0"]) == 0
    assert "in the record already" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.main(["--smoke", "--out", str(tmp_path), "--rows", "shedule"])


def test_every_time_to_accuracy_row_is_a_config_vitpe_accepts():
    """A row's overrides meet its config only when its run starts, minutes into a study: each is resolved here."""
    from vitpe.training import resolve_config

    study = load_benchmark("time_to_accuracy")
    for suite, (rows, _, _) in study.SUITES.items():
        for row, r in rows.items():
            cfg = resolve_config(r.spec.config, r.spec.overrides)
            assert r.after is None or r.after in rows, (suite, row)
            assert ("schedule" in row) == (cfg.train.resolution_schedule is not None), (suite, row)


def test_the_time_to_accuracy_table_is_the_record():
    """docs/time_to_accuracy/table.md is what --report makes of the committed record, and docs/benchmarks.md shows its rows."""
    import tempfile

    study = load_benchmark("time_to_accuracy")
    rows = study.load_results()
    assert {r["suite"] for r in rows} >= {"main"} and all(r["n"] == (5000 if r["suite"] == "main" else 10000) for r in rows)
    with tempfile.TemporaryDirectory() as d:
        assert study.report(rows, Path(d)).read_text() == (ROOT / "docs" / "time_to_accuracy" / "table.md").read_text()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    table = [line for line in (ROOT / "docs" / "time_to_accuracy" / "table.md").read_text().splitlines() if line.startswith("| ")]
    assert table and all(line in page for line in table[2:])


def test_the_finish_docs_show_is_the_finish_the_study_measured():
    """docs/training.md's finish command sets what the study's finish row set (its precision aside), so the page's
    numbers are for the command a user copies."""
    study = load_benchmark("time_to_accuracy")
    line = next(ln for ln in (ROOT / "docs" / "training.md").read_text().splitlines() if "--init runs/A" in ln)
    shown = [o.strip('"') for o in re.findall(r'--set ("[^"]+"|\S+)', line)]
    assert shown == [o for o in study.FINISH_AT_32 if not o.startswith("train.amp")]
    assert "--config configs/shapes.yaml" in line and study.SUITES["main"][0]["6 epochs + finish"].spec.overrides == study.FINISH_AT_32


def test_streaming_smoke_measures_a_folder_read_a_batch_at_a_time(tmp_path, capsys):
    study = load_benchmark("streaming")
    assert study.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| first-40-stream | 40 | 32 | streamed |" in out and "| train16-40-stream | 16 | streamed | 0 | on |" in out
    assert "| train16-40-shards | 16 | tar shards | 0 | on |" in out and (tmp_path / "shards40" / "shards.json").is_file()
    assert len(list((tmp_path / "photos40").rglob("*.jpg"))) == 40


def test_route_planner_smoke(capsys):
    assert load_benchmark("route_planner").main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "$ python eval.py runs/one --plan 8" in out and "\nat 8 px: " in out and "resize to 16" in out
