"""timm's file layout (vitpe.save_pretrained / vitpe.from_pretrained): config.json + model.safetensors, loaded back by
vitpe and by timm.create_model("vitpe_vit", pretrained=True, ...) as the same model; bad files are one line each."""
import json
from pathlib import Path

import pytest
import timm
import torch

import vitpe
from vitpe.checkpoint import CheckpointError
from vitpe.config import ConfigError


def small(**kw):
    torch.manual_seed(0)
    args = {**dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, pos_embed="learned+rope_mixed"), **kw}
    return vitpe.VisionTransformer(**args).eval()


@pytest.mark.parametrize("kw", [{}, {"pool": "map", "final_norm": "pooled", "class_token": False}, {"distilled": True, "num_reg_tokens": 2},
                                {"coord_mode": "normalize", "mlp_gated": True, "mlp_act": "silu", "qk_norm": True}])
def test_a_saved_model_loads_back_in_vitpe_and_in_timm_as_the_same_function(tmp_path, kw):
    m = small(**kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.coord_mode = "extrapolate" if "coord_mode" not in kw else kw["coord_mode"]  # the mode at saving time is kept
    vitpe.save_pretrained(m, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architecture"] == "vitpe_vit" and config["num_classes"] == 5
    x = torch.randn(2, 3, 48, 40)
    back = vitpe.from_pretrained(tmp_path / "m")
    t = timm.create_model(config["architecture"], pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "m" / "model.safetensors")),
                          **config["model_args"]).eval()
    with torch.no_grad():
        ref = m(x)
        torch.testing.assert_close(back(x), ref, rtol=0, atol=0)
        torch.testing.assert_close(t(x), ref, rtol=0, atol=0)


def test_a_converted_timm_model_saves_and_loads(tmp_path):
    t = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, depth=1).eval()
    v = vitpe.vit_from_timm(t)
    vitpe.save_pretrained(v, tmp_path / "d")
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(vitpe.from_pretrained(tmp_path / "d")(x), t(x), atol=1e-5, rtol=1e-5)


def test_bad_folders_and_files_are_one_line_each(tmp_path):
    m = small()
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        vitpe.from_pretrained(tmp_path / "nowhere")
    d = vitpe.save_pretrained(m, tmp_path / "m")
    with pytest.raises(FileExistsError, match="exists; choose another folder or pass overwrite=True"):
        vitpe.save_pretrained(m, d)
    vitpe.save_pretrained(m, d, overwrite=True)
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file.*truncated"):
        vitpe.from_pretrained(d)
    vitpe.save_pretrained(small(depth=3), d, overwrite=True)
    config = json.loads((d / "config.json").read_text())
    config["model_args"]["depth"] = 2
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not fit this model: .*unexpected"):
        vitpe.from_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not a vitpe model config"):
        vitpe.from_pretrained(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors does not exist"):
        vitpe.from_pretrained(d)


def test_an_exported_run_carries_its_preprocessing_and_classes_through_timms_data_config(tmp_path, capsys):
    """`python -m vitpe.export RUN --hf DIR` writes the run's own normalization (shapes: std about 0.28, not timm's 0.5)
    and class names; timm's own loader (local-dir:) and data config (resolve_data_config) then score the run's test
    images exactly as the run does, and vitpe.from_pretrained gives the same back."""
    from timm.data import resolve_data_config

    from vitpe import training
    from vitpe.checkpoint import checkpoint_config, model_from_checkpoint
    from vitpe.cli.export import main as export_main
    from vitpe.evaluation import dataset_of, evaluate

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    assert training.train(tiny, [f"out_dir={tmp_path}", "name=run", "train.epochs=2"]) == 0
    assert export_main([str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    model, state = model_from_checkpoint(tmp_path / "run")
    data = state["data"]
    assert max(data["std"]) < 0.4  # the case that matters: far from timm's 0.5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["label_names"] == data["classes"] and config["pretrained_cfg"]["input_size"] == [3, 16, 16]
    theirs = timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True).eval()
    prep = resolve_data_config({}, model=theirs)
    assert prep["mean"] == pytest.approx(tuple(data["mean"])) and prep["std"] == pytest.approx(tuple(data["std"]))
    assert prep["input_size"] == (3, 16, 16) and prep["interpolation"] == "bicubic" and prep["crop_pct"] == 1.0
    x, y = dataset_of(checkpoint_config(state)).split(False)
    m, s = torch.tensor(prep["mean"]).view(1, -1, 1, 1), torch.tensor(prep["std"]).view(1, -1, 1, 1)
    with torch.no_grad():
        timm_top1 = (theirs((x.float() / 255 - m) / s).argmax(1) == y).float().mean().item()
    assert timm_top1 == pytest.approx(evaluate(model, x, y, data["mean"], data["std"])["top1"], abs=1e-6)
    back = vitpe.from_pretrained(tmp_path / "hf")
    assert back.pretrained_cfg["label_names"] == data["classes"] and back.pretrained_cfg["std"] == pytest.approx(data["std"])
    # predict takes the exported folder as it takes the run: the same classes and probabilities
    from PIL import Image

    from vitpe.cli.predict import main as predict_main

    files = []
    for i in range(3):
        files.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(x[i].permute(1, 2, 0).numpy()).save(files[-1])
    capsys.readouterr()
    outputs = []
    for source in (tmp_path / "run", tmp_path / "hf"):
        assert predict_main([*files, "--run", str(source), "--json"]) == 0
        outputs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert outputs[0] == outputs[1] and outputs[0][0]["top"][0]["class"] in data["classes"]
    # eval.py takes it too: the data its run trained on (recorded in config.json), the same top-1 at every size
    from vitpe.cli import eval as eval_cmd

    tables = []
    for source, out in ((tmp_path / "run", "ev-run"), (tmp_path / "hf", "ev-hf")):
        assert eval_cmd.main([str(source), "--resolutions", "16", "24", "--diagnostics", "0", "--out", str(tmp_path / out)]) == 0
        tables.append([(r["resolution"], r["top1"], r["n"]) for r in json.loads((tmp_path / out / "results.json").read_text())])
    assert tables[0] == tables[1] and len(tables[0]) == 2
    assert config["vitpe_data"]["name"] == "shapes"
    mine = vitpe.save_pretrained(small(), tmp_path / "mine")  # a model of one's own: no data recorded, so eval asks for it
    with pytest.raises(ConfigError, match="does not record the data its model was trained on; give it: --data NAME"):
        eval_cmd.main([str(mine), "--resolutions", "16"])


def test_the_shipped_files_are_checked_and_readable(tmp_path):
    """config.json records the weights' sha256: a flipped bit is one line, not a silently different model; both files
    get the user's usual permissions; names and normalization given in Python are written, wrong lengths refused."""
    d = vitpe.save_pretrained(small(), tmp_path / "m", mean=[0.1, 0.2, 0.3], std=[0.2] * 3, label_names=list("abcde"))
    config = json.loads((d / "config.json").read_text())
    assert config["pretrained_cfg"]["mean"] == [0.1, 0.2, 0.3] and config["label_names"] == list("abcde")
    assert (d / "model.safetensors").stat().st_mode & 0o777 == (d / "config.json").stat().st_mode & 0o777
    assert vitpe.from_pretrained(d).pretrained_cfg["label_names"] == list("abcde")
    weights = bytearray((d / "model.safetensors").read_bytes())
    weights[-3] ^= 0x10  # inside the last tensor: the file still parses
    (d / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CheckpointError, match="sha256 differs from the recorded .*export the model again"):
        vitpe.from_pretrained(d)
    with pytest.raises(ValueError, match="label_names has 2 values and the model has 5 classes"):
        vitpe.save_pretrained(small(), tmp_path / "n", label_names=["a", "b"])
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("key,value,message", [
    ("num_heads", 0, r"num_heads=0 is out of range; it must be in \[1, inf\)"),
    ("depth", -1, "depth=-1 is out of range"),
    ("embed_dim", "64", "embed_dim must be a whole number, got '64'"),
    ("norm_eps", -1, r"norm_eps=-1 is out of range; it must be in \(0, inf\)"),  # once loaded, with NaN logits
    ("embed_dim", 1e9, "describes a model of about .* parameters, but its weights hold .*changed or damaged"),
    ("mlp_ratio", float("inf"), "mlp_ratio=inf is out of range"),
])
def test_absurd_model_arguments_are_one_line_before_anything_is_allocated(tmp_path, key, value, message):
    """A config.json or checkpoint whose model_args were edited or damaged: one CheckpointError line naming the value
    (not a ZeroDivisionError, a TypeError, NaN logits, or an allocation of a billion-wide model), from both loaders."""
    from vitpe.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint
    from vitpe.finetune import InitError, read_source

    d = vitpe.save_pretrained(small(), tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["model_args"][key] = value
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        vitpe.from_pretrained(d)
    m = small()
    path = tmp_path / "checkpoint.pt"
    args = dict(json.loads(json.dumps(m.model_args)), **{key: value})  # plain values, as a run saves them
    save_checkpoint({"model": m.state_dict(), "model_args": args, "config": {}}, path)
    load_checkpoint(path)  # the file itself is sound
    with pytest.raises(CheckpointError, match=message):
        model_from_checkpoint(path)
    with pytest.raises(InitError, match=message):
        read_source(str(path))


def test_a_config_nested_too_deep_or_weights_that_claim_51_gb_are_one_line(tmp_path):
    d = vitpe.save_pretrained(small(), tmp_path / "m")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="is not a vitpe model config"):
        vitpe.from_pretrained(d)
    d = vitpe.save_pretrained(small(), tmp_path / "m", overwrite=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [113_000, 113_000], "data_offsets": [0, 4 * 113_000 ** 2]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        vitpe.from_pretrained(d)
