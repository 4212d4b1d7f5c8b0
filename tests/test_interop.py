"""timm interoperability: vitpe PEs inside timm ViTs, and timm weights inside vitpe's ViT."""
import pytest
import timm
import torch

import vitpe

from conftest import ALL_PE


def timm_vit(**kw):
    kw = {"pretrained": False, "num_classes": 7, "dynamic_img_size": True, "depth": 2, **kw}
    return timm.create_model("vit_tiny_patch16_224", **kw).eval()


def test_timm_weights_load_into_vitpe_with_the_same_logits(monkeypatch):
    torch.manual_seed(0)
    t = timm_vit()
    with torch.no_grad():  # random init leaves pos_embed tiny; make it matter
        t.pos_embed.normal_(std=0.5)
    v = vitpe.vit_from_timm(t)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-4, rtol=1e-4)
        # At a new resolution timm resamples its table with F.interpolate(bicubic); vitpe samples the same
        # bicubic function at the new coordinates. (timm adds antialias=True, which for bicubic switches
        # PyTorch to a different kernel, a=-0.5; without it the two agree.)
        import timm.models.vision_transformer as tv
        from functools import partial

        monkeypatch.setattr(tv, "resample_abs_pos_embed", partial(tv.resample_abs_pos_embed, antialias=False))
        x2 = torch.randn(1, 3, 448, 320)
        torch.testing.assert_close(v(x2), t(x2), atol=1e-4, rtol=1e-4)


def test_timm_weights_with_register_tokens_and_mean_pooling():
    torch.manual_seed(0)
    t = timm_vit(reg_tokens=2, global_pool="avg", fc_norm=False)
    v = vitpe.vit_from_timm(t)
    assert v.num_prefix_tokens == 3 and v.pool == "mean"
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-4, rtol=1e-4)


def test_unsupported_timm_models_are_refused_clearly():
    with pytest.raises(ValueError, match="LayerScale"):
        vitpe.vit_from_timm(timm_vit(init_values=1e-5))
    with pytest.raises(ValueError, match="expected a timm VisionTransformer"):
        vitpe.equip_timm_vit(torch.nn.Linear(2, 2))


def test_equipped_learned_pe_keeps_the_timm_function():
    torch.manual_seed(0)
    t = timm_vit()
    with torch.no_grad():
        t.pos_embed.normal_(std=0.5)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        before = t(x)
        vitpe.equip_timm_vit(t, "learned")
        torch.testing.assert_close(t(x), before, atol=1e-4, rtol=1e-4)
    assert t.pos_embed is None and "vitpe_pos_embed.table" in t.state_dict()


@pytest.mark.parametrize("pe", ALL_PE)
def test_equipped_timm_vit_trains_and_runs_at_new_resolutions(pe):
    torch.manual_seed(0)
    t = vitpe.equip_timm_vit(timm_vit(), pe).train()
    for size in [(224, 224), (448, 448), (224, 320)]:
        out = t(torch.randn(2, 3, *size))
        assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.square().mean().backward()
    pe_params = list(t.vitpe_pos_embed.parameters())
    assert all(p.grad is not None for p in pe_params)


def test_equipped_timm_vit_matches_vitpe_vit_with_the_same_weights():
    """The same weights in both models give the same logits with a rotary + bias PE, at a new resolution."""
    torch.manual_seed(0)
    t = timm_vit()
    v = vitpe.vit_from_timm(t, pos_embed="rel_bias+rope_mixed")
    vitpe.equip_timm_vit(t, "rel_bias+rope_mixed")
    t.vitpe_pos_embed.load_state_dict(v.pos_embed.state_dict())
    with torch.no_grad():
        for p in t.vitpe_pos_embed.parameters():
            p.mul_(10)
        v.pos_embed.load_state_dict(t.vitpe_pos_embed.state_dict())
    x = torch.randn(1, 3, 320, 256)
    with torch.no_grad():
        torch.testing.assert_close(t(x), v(x), atol=1e-4, rtol=1e-4)
