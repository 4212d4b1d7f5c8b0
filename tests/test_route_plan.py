"""The route planner (vitpe.route_plan, eval.py --plan): every route measured on the run's held-out data, the choice,
the plan kept in the run and used by --route auto in eval.py, predict and export; refusals of plans that do not apply.

The runs are trained here on a folder of stripes whose class is their period in pixels: a model trained at 32 px only
cannot read the periods at other sizes from new coordinates (the stripes are twice as wide at 64 px), but the patch
route and resizing give it back its own pixels; a model trained at 16 and 32 px reads them at 16 px on new coordinates,
and that route is the cheapest there (4 tokens against 16)."""
import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitpe import VisionTransformer
from vitpe.checkpoint import checkpoint_config, model_from_checkpoint
from vitpe.cli import eval as eval_cmd
from vitpe.cli import export as export_cmd
from vitpe.cli import predict as predict_cmd
from vitpe.cli import train as train_cmd
from vitpe.data.images import read_images
from vitpe.evaluation import dataset_of, route_logits
from vitpe.route_plan import PLAN_NAME, Route, candidate_routes, choose, load_plan, plan_routes, report_lines, wilson_interval

PERIODS = (4, 8, 16)


def stripes(root: Path, n_train: int = 100, n_test: int = 40, size: int = 32, seed: int = 0) -> Path:
    """An image folder (train/ and test/) of horizontal or vertical stripes, a class per period in pixels."""
    rng = np.random.default_rng(seed)
    t = np.arange(size)
    for split, n in (("train", n_train), ("test", n_test)):
        for p in PERIODS:
            d = root / split / f"period{p}"
            d.mkdir(parents=True)
            for i in range(n):
                wave = 0.5 + 0.5 * np.sign(np.sin(2 * np.pi * (t + rng.uniform(0, p)) / p))
                img = np.broadcast_to(wave[None, :] if rng.random() < 0.5 else wave[:, None], (size, size))
                img = img * rng.uniform(0.6, 1.0) + rng.normal(0, 0.05, (size, size))
                Image.fromarray((np.clip(img, 0, 1) * 255).astype(np.uint8)).convert("RGB").save(d / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs on the stripes: ``one`` trained at 32 px only, ``multi`` at 16 and 32 px (a size per batch); each planned
    at 16 and 64 px."""
    base = tmp_path_factory.mktemp("plan")
    folder = stripes(base / "stripes")
    out = base / "runs"
    common = ["--config", "tiny", "--data", f"imagefolder:{folder}", "--out-dir", str(out), "--epochs", "20", "--set", "model.img_size=32",
              "--set", "model.patch_size=8", "--set", "data.train_size=null", "--set", "data.test_size=null", "--set", "data.augment=none"]
    assert train_cmd.main(common + ["--name", "one"]) == 0
    assert train_cmd.main(common + ["--name", "multi", "--set", "train.resolutions=[16,32]"]) == 0
    return {"folder": folder, "one": out / "one", "multi": out / "multi"}


@pytest.fixture(scope="module")
def planned(runs):
    """Each run's plan at 16 and 64 px (the one-size run's in two commands: the second keeps the first's size), and what
    the last command printed."""
    out = {"printed": io.StringIO()}
    assert eval_cmd.main([str(runs["multi"]), "--plan", "16", "64"]) == 0
    assert eval_cmd.main([str(runs["one"]), "--plan", "16"]) == 0
    with contextlib.redirect_stdout(out["printed"]):
        assert eval_cmd.main([str(runs["one"]), "--plan", "64"]) == 0
    return {**out, "one": load_plan(runs["one"]), "multi": load_plan(runs["multi"])}


def test_the_wilson_interval_holds_the_proportion_and_narrows_with_more_images():
    for hits, n in ((0, 20), (7, 20), (20, 20), (4900, 5000)):
        low, high = wilson_interval(hits, n)
        assert 0 <= low <= hits / n <= high <= 1 and high - low > 0
    assert wilson_interval(0, 20)[0] == 0 and wilson_interval(20, 20)[1] == 1
    width = [wilson_interval(n // 2, n)[1] - wilson_interval(n // 2, n)[0] for n in (100, 400, 1600)]
    assert width[0] > width[1] > width[2] and math.isclose(width[0] / width[1], 2, rel_tol=0.05)  # 1 / sqrt(n)


def row(route, top1, low, high, tokens, speed, minutes=None):
    return {"route": route, "top1": top1, "low": low, "high": high, "tokens": tokens, "images_per_s": speed,
            **({} if minutes is None else {"minutes": minutes})}


def test_routes_whose_intervals_overlap_tie_and_the_cheaper_wins():
    coords, patch, resize = row("coords:interpolate", 0.99, 0.98, 0.995, 256, 300), row("patch", 0.985, 0.975, 0.99, 64, 1700), \
        row("resize", 0.984, 0.974, 0.99, 64, 1600)
    assert choose([coords, patch, resize]) == {"route": "patch", "best": "coords:interpolate", "tied": ["coords:interpolate", "resize"]}
    assert choose([coords, resize])["route"] == "resize"  # the same tokens as patch, but a resize step more
    apart = row("patch", 0.90, 0.88, 0.92, 64, 1700)
    assert choose([coords, apart]) == {"route": "coords:interpolate", "best": "coords:interpolate", "tied": []}  # no overlap: the best
    tuned = row("finetune", 0.995, 0.99, 0.999, 256, 300, minutes=3.0)
    assert choose([tuned, patch])["route"] == "patch"  # a tie with a fine-tune: no training wins
    assert choose([tuned, apart])["route"] == "finetune"


def test_the_candidates_are_the_modes_that_give_the_model_its_own_coordinates_and_differ_at_the_size():
    sincos = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="sincos2d")
    names = lambda size: [r.name for r in candidate_routes(sincos, size)]  # noqa: E731
    # normalize maps the trained grid elsewhere (not the trained model); extend equals extrapolate on a square
    assert names((64, 64)) == ["coords:interpolate", "coords:extrapolate", "patch", "resize"]
    assert names((32, 64)) == ["coords:interpolate", "coords:extrapolate", "resize"]  # extend: extrapolate along the longer side
    assert names((48, 96)) == ["coords:interpolate", "coords:extrapolate", "resize"]  # both sides longer: extend extrapolates both
    assert names((24, 64)) == ["coords:interpolate", "coords:extrapolate", "coords:extend", "resize"]  # one shorter, one longer
    assert names((32, 32)) == ["coords:interpolate"]  # the model's own size: the model itself
    peg = VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="peg")
    assert [r.name for r in candidate_routes(peg, (64, 64))] == ["coords:interpolate", "patch", "resize"]  # reads no coordinates


def test_the_plan_chooses_the_measured_best_and_the_answer_differs_by_model(planned, runs):
    for plan in (planned["one"], planned["multi"]):
        for key, entry in plan["sizes"].items():
            assert entry["choice"] == choose(entry["routes"])["route"] == entry["use"]  # no fine-tune asked: the same
            best = max(entry["routes"], key=lambda r: r["top1"])
            chosen = next(r for r in entry["routes"] if r["route"] == entry["choice"])
            assert chosen["high"] >= best["low"]  # the chosen route is the best or ties with it
            assert all(r["tokens"] >= chosen["tokens"] for r in entry["routes"] if r["high"] >= best["low"])
    one, multi = planned["one"]["sizes"], planned["multi"]["sizes"]
    assert planned["one"]["own"]["top1"] > 0.85  # the one-size model learned the periods at its own size
    for key in ("16", "64"):  # at other sizes its coordinates see other periods; its own pixels come back by patch or resize
        assert one[key]["choice"] in ("patch", "resize")
        coords = max(r["high"] for r in one[key]["routes"] if r["route"].startswith("coords"))
        assert coords < next(r for r in one[key]["routes"] if r["route"] == one[key]["choice"])["low"]
    assert multi["16"]["choice"].startswith("coords:")  # trained at 16 px too: new coordinates, and the cheapest
    # the command's first line is the answer; the plan sits beside config.yaml and records what it was measured on
    out = planned["printed"].getvalue()
    assert out.startswith("at 64 px: ") and "img/s" in out.splitlines()[0] and "peak memory" in out
    plan = json.loads((runs["one"] / PLAN_NAME).read_text())
    assert set(plan["sizes"]) == {"16", "64"}  # a new measurement at 64 kept the plan's 16
    assert plan["data"]["n"] == 120 and len(plan["data"]["fingerprint"]) == 64 and plan["checkpoint"]["checksum"]


def test_route_auto_gives_the_chosen_routes_numbers_in_eval_predict_and_onnx(planned, runs, tmp_path, capsys):
    run, plan = runs["one"], planned["one"]
    choice = Route.parse(plan["sizes"]["64"]["use"], plan["coord_mode"])
    assert eval_cmd.main([str(run), "--resolutions", "64", "--diagnostics", "0", "--out", str(tmp_path / "ev")]) == 0
    (ev,) = json.loads((tmp_path / "ev" / "results.json").read_text())
    planned_row = next(r for r in plan["sizes"]["64"]["routes"] if r["route"] == choice.name)
    assert ev["planned_route"] == choice.name and round(ev["top1"] * ev["n"]) == round(planned_row["top1"] * planned_row["n"])  # the same images right
    # predict: exactly the chosen route's logits, which are not the coordinate route's
    files = sorted((runs["folder"] / "test").rglob("*.png"))[::20]
    capsys.readouterr()
    assert predict_cmd.main([*map(str, files), "--run", str(run), "--size", "64", "--json", "--top", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, state = model_from_checkpoint(run)
    images = read_images(files, 3, (64, 64))
    mean, std = state["data"]["mean"], state["data"]["std"]
    model.coord_mode = choice.coord_mode
    want = route_logits(model, images, mean, std, choice.kind).softmax(-1)
    coords = route_logits(model, images, mean, std, "coords").softmax(-1)
    assert not torch.allclose(want, coords, atol=1e-2)
    for line, p in zip(lines, want):
        assert line["route"] == choice.name
        top = p.topk(3)
        assert [c["p"] for c in line["top"]] == [round(v, 4) for v in top.values.tolist()]
        assert [c["class"] for c in line["top"]] == [state["data"]["classes"][i] for i in top.indices.tolist()]
    # ONNX at 64: the file's preprocessing says what the route needs, and following it gives the route's logits
    onnxruntime = pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    assert export_cmd.main([str(run), "--onnx", str(path), "--size", "64"]) == 0
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    assert meta["vitpe_route"]["route"] == choice.name and meta["vitpe_route"]["size"] == [64, 64]
    from vitpe.data.augment import normalize
    from vitpe.data.datasets import shrink_to

    fed = shrink_to(images, tuple(meta["input_size"][1:])) if choice.kind == "resize" else images
    assert list(fed.shape[-2:]) == meta["input_size"][1:]
    got = torch.from_numpy(session.run(None, {"images": normalize(fed, mean, std).numpy()})[0]).softmax(-1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_plan_of_other_data_or_another_checkpoint_is_refused_and_the_run_keeps_its_files(planned, runs, tmp_path, capsys):
    run = runs["one"]
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    # other held-out data (a subset): the plan's fingerprint differs
    assert eval_cmd.cli([str(run), "--resolutions", "64", "--test-size", "30", "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "other held-out data" in err[-1] and "--plan 64" in err[-1]
    # a route given by hand is still taken
    assert eval_cmd.cli([str(run), "--resolutions", "64", "--test-size", "30", "--route", "coords", "--diagnostics", "0",
                         "--out", str(tmp_path / "b")]) == 0
    # another checkpoint (the plan copied into another run): refused by eval, predict and export alike
    other = tmp_path / "other"
    shutil.copytree(runs["multi"], other)
    shutil.copy(run / PLAN_NAME, other / PLAN_NAME)
    image = str(sorted((runs["folder"] / "test").rglob("*.png"))[0])
    for command in (lambda: eval_cmd.cli([str(other), "--resolutions", "64", "--out", str(tmp_path / "c")]),
                    lambda: predict_cmd.cli([image, "--run", str(other), "--size", "64"]),
                    lambda: export_cmd.cli([str(other), "--onnx", str(tmp_path / "x.onnx"), "--size", "64"])):
        capsys.readouterr()
        assert command() == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert [line for line in err if line.startswith("error: ")] == err[-1:] and "another checkpoint" in err[-1], err
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before


def test_a_route_out_of_the_running_is_stopped_early_and_said(runs):
    model, state = model_from_checkpoint(runs["one"])
    ds = dataset_of(checkpoint_config(state))
    plan = plan_routes(model, state, ds, [(64, 64), (64, 64)], torch.device("cpu"), stop_after=32)
    assert list(plan["sizes"]) == ["64"]  # a size given twice is measured once
    rows = plan["sizes"]["64"]["routes"]
    assert [r["route"] for r in rows] == [r.name for r in candidate_routes(model, (64, 64))]  # shown in the candidates' order
    stopped = [r for r in rows if r.get("stopped")]
    assert stopped and all(r["route"].startswith("coords:") and r["n"] < 120 for r in stopped)
    assert all(r["high"] < max(k["low"] for k in rows if not k.get("stopped")) for r in stopped)  # it could not have tied
    assert any(line.startswith("+ stopped after 64 images") for line in report_lines(plan))


@pytest.mark.parametrize("args, says", [
    (["--plan", "30"], "not a multiple of the patch size 8"),
    (["--plan", "64", "--finetune-min", "0"], "positive number of minutes"),
    (["--plan", "64", "--finetune-min", "nan"], "positive number of minutes"),
    (["--finetune-min", "2"], "give the sizes too"),
    (["--plan", "64", "--route", "patch"], "drop --route"),
])
def test_bad_planner_input_is_one_line_and_changes_nothing(runs, args, says, capsys):
    run = runs["multi"]
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run.iterdir()}
    try:
        code = eval_cmd.cli([str(run), *args])
    except SystemExit as e:  # argparse's own refusal of a value
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1]
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run.iterdir()} == before


@pytest.mark.parametrize("edit, says", [
    (lambda plan: plan["sizes"]["64"].update(use="warp"), "its use 'warp' is not one of the routes measured"),
    (lambda plan: plan.pop("checkpoint"), "'checkpoint' missing"),
    (lambda plan: "{not json", "not JSON"),
])
def test_a_plan_file_edited_by_hand_is_refused_in_one_line(planned, runs, tmp_path, edit, says, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["one"], run)
    plan = json.loads((run / PLAN_NAME).read_text())
    text = edit(plan)
    (run / PLAN_NAME).write_text(text if isinstance(text, str) else json.dumps(plan))
    image = str(sorted((runs["folder"] / "test").rglob("*.png"))[0])
    assert predict_cmd.cli([image, "--run", str(run), "--size", "64"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "--plan" in err[0], err


def test_a_fine_tune_budget_adds_a_measured_fine_tune_with_its_command(runs, tmp_path, capsys):
    run = tmp_path / "one"
    shutil.copytree(runs["one"], run)
    (run / PLAN_NAME).unlink(missing_ok=True)
    assert eval_cmd.main([str(run), "--plan", "64", "--finetune-min", "0.05"]) == 0
    entry = load_plan(run)["sizes"]["64"]
    tuned = next(r for r in entry["routes"] if r["route"] == "finetune")
    assert tuned["minutes"] > 0 and Path(tuned["run"]).is_dir() and (Path(tuned["run"]) / "checkpoint.pt").is_file()
    assert tuned["command"].startswith(f"python train.py --init {run} --set 'train.resolutions=[64]'")
    assert "train.budget_min=0.05" in tuned["command"] and 0 <= tuned["top1"] <= 1
    assert entry["use"] != "finetune"  # --route auto takes a route of this model itself


def test_timm_layout_ships_the_model_at_its_own_size_and_refuses_a_route(runs, tmp_path, capsys):
    assert export_cmd.cli([str(runs["one"]), "--hf", str(tmp_path / "hf"), "--size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ships as ONNX" in err[0] and not (tmp_path / "hf").exists()


def test_a_plan_stopped_part_way_writes_nothing(runs, tmp_path, monkeypatch, capsys):
    run = tmp_path / "one"
    shutil.copytree(runs["one"], run)
    before = (run / PLAN_NAME).read_bytes()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while a route is measured

    monkeypatch.setattr(eval_cmd, "plan_routes", stopped)
    assert eval_cmd.main([str(run), "--plan", "64"]) == 130
    assert "no plan written" in capsys.readouterr().err and (run / PLAN_NAME).read_bytes() == before
