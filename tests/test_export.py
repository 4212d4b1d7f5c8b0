"""vitpe.export_onnx: one ONNX graph for every input size, checked with onnxruntime against PyTorch at sizes it was not
traced at; every family exports or says in one line why not; python -m vitpe.export writes ONNX and timm's layout."""
import re
from pathlib import Path

import pytest
import torch
from conftest import ALL_PE

import vitpe
from vitpe.cli import train as train_cmd
from vitpe.cli.export import cli as export_cli
from vitpe.cli.export import main as export_main

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
SIZES = [(32, 24), (48, 64), (20, 12)]  # the training size, larger and wider, smaller and narrower (traced at 36x32)


def model(pe, **kw):
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=(32, 24), patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5, pos_embed=pe,
                                num_reg_tokens=1, **kw).eval()
    with torch.no_grad():  # every weight matters, zero-initialised tables and heads included
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.mark.parametrize("pe", ALL_PE)
def test_every_family_exports_a_graph_for_any_size_or_says_why_not(pe, tmp_path):
    m = model(pe)
    why = vitpe.onnx.onnx_refusal(m)
    if why:
        with pytest.raises(ValueError, match=f"^the '{re.escape(pe)}' PE cannot be exported to ONNX: .*, which ONNX has no operator for$"):
            vitpe.export_onnx(m, tmp_path / "m.onnx")
        assert not (tmp_path / "m.onnx").exists()
        return
    path = vitpe.export_onnx(m, tmp_path / "m.onnx")
    graph = onnx.load(str(path)).graph
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"]
    assert not any("omplex" in n.op_type for n in graph.node)  # rotations are real-valued
    errors = vitpe.onnx_errors(m, path, SIZES)
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.parametrize("pe,kw", [
    ("learned", {"coord_mode": "extrapolate"}),
    ("rel_bias", {"coord_mode": "normalize"}),
    ("rope_axial", {"coord_mode": "extend", "pos_embed_kwargs": {"scaling": "yarn", "p_rope": 0.25}}),
    ("rope_mixed", {"coord_mode": "extrapolate", "pos_embed_kwargs": {"scaling": "ntk"}}),
    ("learned", {"pos_embed_kwargs": {"antialias": True}, "pool": "mean"}),  # timm's resize, antialiased, in plain ops
    ("sincos2d", {"pool": "map", "class_token": False}),
])
def test_coordinate_modes_rope_controls_and_heads_export_as_they_run(pe, kw, tmp_path):
    m = model(pe, **kw)
    errors = vitpe.onnx_errors(m, vitpe.export_onnx(m, tmp_path / "m.onnx"), SIZES + [(64, 24)])
    assert max(errors.values()) <= 1e-4, errors


def test_converted_timm_models_export_at_any_size(tmp_path):
    timm = pytest.importorskip("timm")
    for name in ("deit_tiny_patch16_224", "eva02_tiny_patch14_224"):  # an antialiased table; EVA's RoPE from patch corners
        v = vitpe.vit_from_timm(timm.create_model(name, pretrained=False, depth=1).eval())
        (h, w), p = v.img_size, v.patch_size
        errors = vitpe.onnx_errors(v, vitpe.export_onnx(v, tmp_path / f"{name}.onnx"), [(h, w), (h + 2 * p, w + 4 * p)], batch=1)
        assert max(errors.values()) <= 1e-4, (name, errors)


def test_export_never_overwrites_silently_and_refuses_in_one_line(tmp_path):
    m = model("sincos2d")
    path = vitpe.export_onnx(m, tmp_path / "m.onnx")
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        vitpe.export_onnx(m, path)
    assert path.read_bytes() == before and m.training is False
    vitpe.export_onnx(m.train(), path, overwrite=True)
    assert m.training  # exported in eval mode, handed back as it came
    with pytest.raises(FileNotFoundError, match="folder .* does not exist"):
        vitpe.export_onnx(m, tmp_path / "nowhere" / "m.onnx")
    with pytest.raises(ValueError, match="takes a vitpe.VisionTransformer"):
        vitpe.export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="^the 'learned' PE .*learned.square takes the grid's longer side"):
        vitpe.export_onnx(model("learned", pos_embed_kwargs={"square": True}), tmp_path / "sq.onnx")


def test_the_export_command_writes_onnx_and_timms_layout_from_a_run_with_the_weights_named(tmp_path, capsys):
    from vitpe.checkpoint import model_from_checkpoint

    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "run", "--epochs", "1",
                              "--set", "train.ema_decay=0.5"]) == 0
    run = tmp_path / "run"
    assert export_main([str(run), "--onnx", str(tmp_path / "ema.onnx"), "--hf", str(tmp_path / "hf"), "--check", "16x16", "24x32"]) == 0
    out = capsys.readouterr().out
    assert "EMA weights" in out and "onnxruntime at 24x32: relative difference" in out
    assert export_main([str(run), "--onnx", str(tmp_path / "raw.onnx"), "--raw"]) == 0
    ema, _ = model_from_checkpoint(run, ema=True)
    raw, _ = model_from_checkpoint(run, ema=False)
    for weights, name in ((ema, "ema.onnx"), (raw, "raw.onnx")):
        assert max(vitpe.onnx_errors(weights, tmp_path / name, [(16, 16), (24, 32)]).values()) <= 1e-4
    x = torch.randn(2, 3, 24, 32)
    with torch.no_grad():
        assert torch.equal(vitpe.from_pretrained(tmp_path / "hf")(x), ema(x))
    # the graph carries what its images need: the run's normalization and classes, as the timm layout does
    import json

    import onnxruntime

    meta = {k: json.loads(v) for k, v in onnxruntime.InferenceSession(str(tmp_path / "ema.onnx")).get_modelmeta().custom_metadata_map.items()}
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert meta["mean"] == config["pretrained_cfg"]["mean"] and meta["std"] == config["pretrained_cfg"]["std"] != [0.5] * 3
    assert meta["label_names"] == config["label_names"] and meta["input_size"] == [3, 16, 16]
    assert export_cli([str(run), "--onnx", str(tmp_path / "ema.onnx")]) == 2  # exists: kept, one line
    assert "exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(run)])  # nothing asked for


@pytest.mark.parametrize("kw", [{"norm_layer": "rmsnorm"}, {"content_keep": 0.5}])
def test_valid_models_once_refused_export_and_agree_at_any_size(kw, tmp_path):
    """rmsnorm (no RMS norm in opset 17: once 220 lines of IR on stdout) and content_keep < 1 (once a TypeError from
    round): both export, and the graph keeps the same patches and values as PyTorch at sizes it was not traced at."""
    m = model("sincos2d", **kw)
    x = torch.rand(2, 3, 32, 24)
    x[:, :, 8:20, 4:16] += 2.0  # content in the middle, background at the border: content_keep picks real patches
    errors = vitpe.onnx_errors(m, vitpe.export_onnx(m, tmp_path / "m.onnx"), SIZES)
    assert max(errors.values()) <= 1e-4, errors
    import onnxruntime

    with torch.no_grad():
        want = m(x)
    got = onnxruntime.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"images": x.numpy()})[0]
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-4)


def test_the_graph_and_its_checker_refuse_what_pytorch_refuses(tmp_path):
    """An input whose sides are not multiples of the patch size: PyTorch refuses it, and the graph once answered for its
    top-left crop; now the runtime refuses it. bf16 and fp64 models (graphs onnxruntime rejects or cannot run), a batch
    of 0 and another model's file are one line each."""
    import numpy as np
    import onnxruntime

    m = model("rope_mixed")
    path = vitpe.export_onnx(m, tmp_path / "m.onnx")
    session = onnxruntime.InferenceSession(str(path))
    assert session.run(None, {"images": np.zeros((1, 3, 16, 20), np.float32)})[0].shape == (1, 5)
    with pytest.raises(Exception, match="Reshape"):
        session.run(None, {"images": np.zeros((1, 3, 17, 23), np.float32)})
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float64, "float64")):
        with pytest.raises(ValueError, match=f"^the model's weights are {name}; ONNX export takes float32: export model.float"):
            vitpe.export_onnx(model("sincos2d").to(dtype), tmp_path / f"{name}.onnx")
        assert not (tmp_path / f"{name}.onnx").exists()
    with pytest.raises(ValueError, match="at least one image per batch, got batch=0"):
        vitpe.onnx_errors(m, path, [(16, 16)], batch=0)
    other = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, in_chans=1).eval()
    with pytest.raises(ValueError, match="does not run on this model's input .* is it this model's file"):
        vitpe.onnx_errors(other, path, [(16, 16)])
    three = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3).eval()
    with pytest.raises(ValueError, match=r"gives logits of shape \(2, 5\) and the model \(2, 3\): it is another model's file"):
        vitpe.onnx_errors(three, path, [(16, 16)])
    (tmp_path / "junk.onnx").write_bytes(b"not a graph")
    with pytest.raises(ValueError, match="is not an ONNX file onnxruntime can run"):
        vitpe.onnx_errors(m, tmp_path / "junk.onnx", [(16, 16)])
    with pytest.raises(ValueError, match="not a multiple of patch_size 4"):
        vitpe.onnx_errors(m, path, [(17, 23)])


def test_the_export_command_never_destroys_its_run_and_says_each_failure_in_one_line(tmp_path, capsys):
    """--onnx at the run's own checkpoint (once replaced by the graph), at another checkpoint, at a folder, or on a disk
    that fills: one line, exit 2, the checkpoint intact and no .tmp left; --check sizes are N or HxW,
    positive, and a size that cannot fit in memory is refused by the plan before anything is allocated."""
    import errno
    import subprocess
    import sys

    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "run", "--epochs", "1"]) == 0
    run = tmp_path / "run"
    checkpoint = (run / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    for target in (run / "checkpoint.pt", run):
        assert export_cli([str(run), "--onnx", str(target), "--overwrite"]) == 2
        assert (run / "checkpoint.pt").read_bytes() == checkpoint
    err = capsys.readouterr().err
    assert "is the run's own checkpoint; write the graph elsewhere" in err and "is a folder; give the file to write" in err
    torch.save({"a": 1}, tmp_path / "other.pt")
    assert export_cli([str(run), "--onnx", str(tmp_path / "other.pt"), "--overwrite"]) == 2
    assert "is a PyTorch checkpoint, not an ONNX file" in capsys.readouterr().err
    real_write = Path.write_bytes

    def full_disk(self, data):  # the disk fills halfway through the file
        real_write(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "write_bytes", full_disk)
        (tmp_path / "full").mkdir()
        assert export_cli([str(run), "--onnx", str(tmp_path / "full" / "m.onnx")]) == 2
    assert "cannot write" in capsys.readouterr().err and not list((tmp_path / "full").iterdir())  # no .tmp left
    for bad in ("0x0", "16x", "x"):
        with pytest.raises(SystemExit):
            export_main([str(run), "--onnx", str(tmp_path / "m.onnx"), "--check", bad])
        assert "must be positive" in capsys.readouterr().err or bad != "0x0"
    assert export_main([str(run), "--onnx", str(tmp_path / "m.onnx"), "--check", "24"]) == 0  # N: a square size
    assert "onnxruntime at 24x24" in capsys.readouterr().out
    assert export_cli([str(run), "--onnx", str(tmp_path / "big.onnx"), "--check", "16384x16384"]) == 2
    assert "resolution 16384x16384 needs about" in capsys.readouterr().err and not (tmp_path / "big.onnx").exists()
    help_run = subprocess.run([sys.executable, "-m", "vitpe.export", "--help"], capture_output=True, text=True)
    assert help_run.returncode == 0 and "found in sys.modules" not in help_run.stderr  # runpy's warning, once on every run
