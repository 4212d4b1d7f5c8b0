"""timm's file layout (vitpe.save_pretrained / vitpe.from_pretrained): config.json + model.safetensors, loaded back by
vitpe and by timm.create_model("vitpe_vit", pretrained=True, ...) as the same model; bad files are one line each."""
import json

import pytest
import timm
import torch

import vitpe
from vitpe.checkpoint import CheckpointError


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
