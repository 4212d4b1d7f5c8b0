"""Resolution robustness: FlexiViT patch resizing, coordinate augmentation, multi-resolution training."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vitpe
from vitpe.checkpoint import load_checkpoint
from vitpe.cli import eval as eval_cmd
from vitpe.cli import train as train_cmd
from vitpe.config import ConfigError
from vitpe.patch import resize_matrix, resize_patch_embed

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


@pytest.mark.parametrize("new", [6, 8, 13])
def test_pi_resize_preserves_every_patch_response_when_upsampling(new):
    w = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    w2 = resize_patch_embed(w, new)
    x = torch.randn(7, 3, 4, 4, dtype=torch.float64)
    x2 = (resize_matrix(4, new) @ x.reshape(7, 3, 16, 1)).reshape(7, 3, new, new)  # each patch resized
    torch.testing.assert_close(torch.einsum("ncij,dcij->nd", x2, w2), torch.einsum("ncij,dcij->nd", x, w))
    assert torch.equal(resize_patch_embed(w, 4), w)


def test_resize_matrix_is_the_image_resize():
    x = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    ref = F.interpolate(x, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
    torch.testing.assert_close((resize_matrix(4, 8) @ x.flatten()).view(1, 1, 8, 8), ref)


def test_patch_route_keeps_the_model_function():
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5, pos_embed="rope_mixed+rel_bias").eval()
    x = torch.randn(2, 3, 16, 16)
    # Upsample each 4x4 patch to 8x8 on its own: the 4x4 token grid is kept, every token is unchanged.
    patches = x.unfold(2, 4, 4).unfold(3, 4, 4)  # (B, C, 4, 4, p, p)
    up = (resize_matrix(4, 8).float() @ patches.reshape(*patches.shape[:4], 16, 1)).reshape(*patches.shape[:4], 8, 8)
    x_up = up.permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x_up, patch_size=8), m(x), atol=1e-4, rtol=1e-4)
    out = m.train()(x_up, patch_size=8)
    out.sum().backward()
    assert m.patch_embed.weight.grad is not None  # patch-size training gets gradients too


def test_coord_aug_is_off_by_default_and_only_in_training():
    torch.manual_seed(0)
    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="sincos2d")
    plain = vitpe.VisionTransformer(**kw)
    aug = vitpe.VisionTransformer(**kw, coord_aug={"shift": 2.0, "rescale": 1.5, "jitter": 1.2})
    aug.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 16, 16)
    assert not plain.coord_aug.active and aug.coord_aug.active
    with torch.no_grad():
        torch.testing.assert_close(aug.eval()(x), plain.eval()(x))
        assert not torch.allclose(aug.train()(x), plain.train()(x))
    with pytest.raises(ValueError, match="coord_aug.zoom is not a coord_aug key"):
        vitpe.VisionTransformer(**kw, coord_aug={"zoom": 2})
    with pytest.raises(ValueError, match="rescale >= 1"):
        vitpe.CoordAugment(rescale=0.5)


def test_a_shift_of_coordinates_leaves_rope_attention_unchanged():
    """RoPE is relative: shifting every coordinate changes nothing; rescaling does. (Only without prefix
    tokens: an unrotated cls token's attention to the patches sees their absolute rotation.)"""
    torch.manual_seed(0)
    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed="rope_axial",
              class_token=False, pool="mean")
    m = vitpe.VisionTransformer(**kw, coord_aug={"shift": 3.0})
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        for b in m.blocks:  # at init attention is near uniform: give it a trained model's sharpness
            b.attn.qkv.weight.mul_(20)
        torch.testing.assert_close(m.train()(x), m.eval()(x), atol=1e-5, rtol=1e-5)
        m.coord_aug = vitpe.CoordAugment(rescale=2.0)
        rescaled, plain = m.train()(x), m.eval()(x)
        assert (rescaled - plain).abs().max() > 1e-3 * plain.abs().max()


def test_augmented_coordinates_stay_a_lattice_for_bias_encodings():
    torch.manual_seed(0)
    g = vitpe.PatchGrid.create((5, 6), (4, 4))
    a = vitpe.CoordAugment(shift=1.0, rescale=1.3, jitter=1.2, per_image=False)(g)  # one draw for the batch
    assert a.key is None and a.spacing is not None
    pe = vitpe.build_pos_embed("cpb+rel_bias", dim=32, num_heads=2, ref_grid=4)
    torch.testing.assert_close(pe.bias(a), pe.bias(vitpe.PatchGrid.from_coords(a.coords, (5, 6), (4, 4))), atol=1e-5, rtol=1e-5)


def test_a_grid_never_holds_coordinates_that_contradict_its_mode():
    """A grid with a coordinate mode is that mode's lattice: the bias families read a lattice's step from the mode, so a
    grid whose coordinates were replaced but whose mode was kept (as the scale probe once made) is refused in one line;
    coordinates given directly carry no mode, and every family reads them."""
    import dataclasses

    g = vitpe.PatchGrid.create((4, 6), (4, 4), "interpolate")
    with pytest.raises(ValueError, match="not the 4x6 grid's in coordinate mode 'interpolate'.*PatchGrid.from_coords"):
        dataclasses.replace(g, coords=g.coords * 2, spacing=None, key=None)
    with pytest.raises(ValueError, match="spacing .* is not the 'interpolate' lattice's"):
        dataclasses.replace(g, spacing=(1.0, 1.0))
    shifted = g.transformed(1.5, 0.5, 0.25, -1.0).transformed(2.0, 1.0, 1.0, 0.0)  # augmentations compose and stay valid
    with pytest.raises(ValueError, match="with its augmentation"):
        dataclasses.replace(shifted, coords=g.coords)
    with pytest.raises(ValueError, match="extent must be \\(w, h\\), two positive numbers"):
        vitpe.PatchGrid.from_coords(g.coords, (4, 6), (4, 4), extent=(0.0, 4.0))
    given = vitpe.PatchGrid.from_coords(g.coords * 2, (4, 6), (4, 4), extent=(8.0, 8.0))
    assert given.mode is None and given.extent().tolist() == [8.0, 8.0]
    for family in ("fire", "lookhere", "alibi2d", "rel_bias", "cpb"):
        pe = vitpe.build_pos_embed(family, dim=32, num_heads=2, ref_grid=4).eval()
        with torch.no_grad():
            assert not torch.allclose(pe.bias(given), pe.bias(g), atol=1e-3), family  # the new coordinates are read


def test_multi_resolution_training_draws_sizes_per_batch(tmp_path, monkeypatch):
    seen = []
    real = vitpe.VisionTransformer.forward

    def spy(self, x, *a, **k):
        if self.training:
            seen.append(x.shape[-1])
        return real(self, x, *a, **k)

    monkeypatch.setattr(vitpe.VisionTransformer, "forward", spy)
    rc = train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "mr", "--set", "train.resolution_range=[8, 24]",
                            "--set", "model.coord_aug={shift: 1.0}", "--pe", "rope_mixed"])
    assert rc == 0 and set(seen) <= {8, 12, 16, 20, 24} and len(set(seen)) >= 3
    cfg = load_checkpoint(tmp_path / "mr")["config"]
    assert cfg["train"]["resolution_range"] == [8, 24] and cfg["model"]["coord_aug"] == {"shift": 1.0}


def test_multi_resolution_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="multiples of model.patch_size=4"):
        train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--set", "train.resolutions=[16, 18]"])
    with pytest.raises(ConfigError, match="model.coord_aug.zoom is not a coord_aug key"):
        train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--set", "model.coord_aug.zoom=2"])


def test_eval_patch_route(tmp_path):
    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "r", "--epochs", "1"]) == 0
    out = tmp_path / "ev"
    assert eval_cmd.main([str(tmp_path / "r"), "--resolutions", "16", "32", "--route", "both", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {(r["route"], r["resolution"]) for r in rows} == {("coords", "16"), ("coords", "32"), ("patch", "16"), ("patch", "32")}
    same = [r["top1"] for r in rows if r["resolution"] == "16"]
    assert same[0] == same[1]  # at the training size both routes are the same model
    with pytest.raises(ConfigError, match="keeps the 4x4 token grid"):
        eval_cmd.main([str(tmp_path / "r"), "--resolutions", "18", "--route", "patch", "--out", str(tmp_path / "x")])


def test_eval_resize_route_is_the_baseline_a_user_has(tmp_path, capsys):
    """--route resize resizes each image back to the model's own size: at the training size it is the coordinate route
    itself, at any other (not a multiple of the patch too) a row of its own; a multi-size model says what it resizes to."""
    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "r", "--epochs", "1"]) == 0
    out = tmp_path / "ev"
    assert eval_cmd.main([str(tmp_path / "r"), "--resolutions", "16", "32", "--route", "all", "--diagnostics", "0",
                             "--test-size", "64", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {(r["route"], r["resolution"]) for r in rows} == {(route, size) for route in ("coords", "patch", "resize") for size in ("16", "32")}
    at = {(r["route"], r["resolution"]): r for r in rows}
    assert at[("resize", "16")]["top1"] == at[("coords", "16")]["top1"] and at[("resize", "32")]["tokens_per_image"] == 16
    assert "(image resized to 16)" in at[("resize", "32")]["label"]
    assert eval_cmd.main([str(tmp_path / "r"), "--resolutions", "18", "--route", "resize", "--diagnostics", "0",
                             "--test-size", "16", "--out", str(tmp_path / "odd")]) == 0  # any size: it is resized anyway
    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "m", "--epochs", "1",
                              "--set", "train.resolutions=[16, 24]"]) == 0
    capsys.readouterr()
    assert eval_cmd.main([str(tmp_path / "m"), "--resolutions", "32", "--route", "resize", "--diagnostics", "0",
                             "--test-size", "16", "--out", str(tmp_path / "mm")]) == 0
    assert "--route resize resizes every image to 16x16" in capsys.readouterr().err
