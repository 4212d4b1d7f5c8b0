"""The benchmark scripts' seconds-long smoke modes, so that they do not rot between hand-run studies."""
import importlib.util
import json
from pathlib import Path

import vitpe

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resolution_transfer_smoke(tmp_path):
    assert load("resolution_transfer").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {r["pe"] for r in rows} == {"learned", "rope_mixed+multires"}
    assert {r["scale"] for r in rows} == {0.5, 0.75, 1.0, 1.5, 2.0, 4.0} and {r["route"] for r in rows} == {"coords", "patch"}
    table = (tmp_path / "table.md").read_text()
    assert "| learned (interpolate) |" in table and (tmp_path / "shapes.png").stat().st_size > 5000
    # A later invocation for other PEs adds to the results instead of replacing them (finished runs are reused).
    assert load("resolution_transfer").main(["--smoke", "--out", str(tmp_path), "--pes", "learned"]) == 0
    again = json.loads((tmp_path / "results.json").read_text())
    assert {r["pe"] for r in again} == {"learned", "rope_mixed+multires"} and len(again) == len(rows)


def test_speed_smoke(tmp_path):
    assert load("speed").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    steps = {r["step"] for r in rows}
    assert {"train", "inference", "train (PE cost)", "matmul peak", "data loading"} <= steps
    assert all(r["ratio_vitpe_over_timm"] > 0 and r["vitpe_peak_mib"] > 0 and r["timm_peak_mib"] > 0 for r in rows if "ratio_vitpe_over_timm" in r)
    md = (tmp_path / "speed.md").read_text()
    assert "| rope_mixed |" in md and "matmul peak" in md and "data loading" in md
    assert {r["pe"] for r in rows if "pe" in r} == set(vitpe.list_pos_embeds()) | {"sincos2d+rope_mixed"}  # every family's cost
    assert load("speed").main(["--smoke", "--part", "pe-cost", "--out", str(tmp_path / "pe")]) == 0
    only = json.loads((tmp_path / "pe" / "pe_cost.json").read_text())["rows"]
    assert {r["step"] for r in only} == {"train (PE cost)"} and "| liere |" in (tmp_path / "pe" / "pe_cost.md").read_text()


def test_accuracy_smoke(tmp_path):
    assert load("accuracy").main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert {(r["pe"], r["seed"]) for r in rows} == {("none", 0), ("none", 1), ("rope_mixed", 0), ("rope_mixed", 1)}
    assert all(0 <= r["top1"] <= 1 and r["params"] > 0 and r["train_wall_s"] > 0 for r in rows)
    table = (tmp_path / "pe_table.md").read_text()
    assert "| rope_mixed |" in table and "±" in table and (tmp_path / "pe_table.png").stat().st_size > 5000
    assert (tmp_path / "accuracy.csv").read_text().count("\n") == 5
    # Seeds differ (different runs), and a second invocation reuses the finished runs instead of retraining.
    assert len({r["run"] for r in rows}) == 4
    assert load("accuracy").main(["--smoke", "--out", str(tmp_path), "--pes", "none"]) == 0
    assert len(json.loads((tmp_path / "accuracy.json").read_text())) == 4
    # Other settings make other runs: an override never silently reuses a run trained without it.
    assert load("accuracy").main(["--smoke", "--out", str(tmp_path), "--pes", "none", "--set", "train.lr=0.01"]) == 0
    rows = json.loads((tmp_path / "accuracy.json").read_text())
    assert len(rows) == 6 and sum(r["recipe"]["train"]["lr"] == 0.01 for r in rows) == 2


def test_per_image_smoke(tmp_path):
    assert load("per_image").main(["--smoke", "--parts", "token_keep", "packing", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "per_image.json").read_text())
    keeps = {(r["arch"], r["token_keep"]) for r in data["token_keep"]}
    assert len(keeps) == 6 and all(r["img_s"] > 0 for r in data["token_keep"])  # three architectures, r = 1 and 0.5
    assert {r["setup"] for r in data["packing"]} == {"16-48 px, rows of 144 tokens", "16-32 px, rows of 64 tokens", "16-32 px, rows of 128 tokens"}
    assert all(0 < r["fill"] <= 1 for r in data["packing"])
    assert "### packing" in (tmp_path / "per_image.md").read_text()


def test_cpu_levers_smoke(tmp_path):
    # compile is left out: its first step compiles for seconds; the part runs in the hand-run benchmark
    assert load("cpu_levers").main(["--smoke", "--out", str(tmp_path), "--parts", "bf16", "adamw", "profile", "--arch", "main"]) == 0
    rows = json.loads((tmp_path / "cpu_levers.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["bf16", "adamw", "profile"]
    prof = rows[-1]
    assert 0 < prof["fraction_of_peak"] < 1.5 and abs(sum(prof["share_by_kind"].values()) - 1) < 1e-6
    assert rows[0]["ratio_bf16_over_fp32"] > 0 and rows[1]["foreach_img_s"] > 0
    assert "of the fp32 matmul peak" in (tmp_path / "cpu_levers.md").read_text()
    assert load("cpu_levers").main(["--smoke", "--out", str(tmp_path / "c"), "--parts", "content", "--arch", "fmnist"]) == 0
    row = json.loads((tmp_path / "c" / "cpu_levers.json").read_text())["rows"][0]
    assert row["keep0.5_img_s"] > 0 and row["ratio_keep0.65_over_keep1"] > 0
