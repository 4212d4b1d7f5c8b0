"""timm interoperability: vitpe PEs inside timm ViTs (on every forward path), timm/RoPE-ViT/Swin weights in vitpe,
and vitpe models in timm's registry."""
from functools import partial

import pytest
import timm
import torch
from conftest import ALL_PE

import vitpe
from vitpe import COORD_MODES


def timm_vit(**kw):
    kw = {"pretrained": False, "num_classes": 7, "dynamic_img_size": True, "depth": 2, **kw}
    m = timm.create_model("vit_tiny_patch16_224", **kw).eval()
    if m.num_classes:
        with torch.no_grad():  # the init head (std 0.02) gives logits near 0, which any model would match at atol 1e-4
            m.head.weight.normal_()
    return m


def no_antialias(monkeypatch, module):
    """timm resizes a table with F.interpolate(bicubic, antialias=True), which for bicubic switches PyTorch to
    another kernel (a=-0.5); the papers' code (DeiT, RoPE-ViT) and vitpe use the plain bicubic (a=-0.75)."""
    monkeypatch.setattr(module, "resample_abs_pos_embed", partial(module.resample_abs_pos_embed, antialias=False))


def test_timm_weights_load_into_vitpe_with_the_same_logits(monkeypatch):
    t = timm_vit()
    with torch.no_grad():  # random init leaves pos_embed tiny; make it matter
        t.pos_embed.normal_(std=0.5)
    v = vitpe.vit_from_timm(t)
    plain = vitpe.vit_from_timm(t, pos_embed_kwargs={"antialias": False})
    x, x2 = torch.randn(2, 3, 224, 224), torch.randn(1, 3, 448, 320)
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v(x2), t(x2), atol=1e-4, rtol=1e-4)  # timm's antialiased resize, reproduced
        assert (plain(x2) - t(x2)).abs().max() > 1e-3
        import timm.models.vision_transformer as tv

        no_antialias(monkeypatch, tv)
        torch.testing.assert_close(plain(x2), t(x2), atol=1e-4, rtol=1e-4)  # the papers' plain bicubic


def test_timm_weights_with_register_tokens_mean_pooling_and_layer_scale():
    t = timm_vit(reg_tokens=2, global_pool="avg", fc_norm=False, init_values=0.5)
    v = vitpe.vit_from_timm(t)
    assert v.num_prefix_tokens == 3 and v.pool == "mean" and isinstance(v.blocks[0].ls1, vitpe.LayerScale)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(v(x), t(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pe", ["rel_bias", "cpb", "learned+rel_bias", "rope_mixed"])
def test_another_pe_takes_only_the_timm_weights_it_can(pe):
    t = timm_vit()
    with torch.no_grad():
        t.pos_embed.normal_(std=0.5)
    v = vitpe.vit_from_timm(t, pos_embed=pe)  # rel_bias used to be mistaken for a learned table (same key name)
    sd = v.state_dict()
    learned = [k for k in sd if k.startswith("pos_embed.") and k.endswith("table") and sd[k].dim() == 4]
    assert len(learned) == int("learned" in pe)
    if learned:
        torch.testing.assert_close(sd[learned[0]].flatten(2)[0].t(), t.pos_embed[0, 1:])
    torch.testing.assert_close(v.blocks[1].mlp.fc2.weight, t.blocks[1].mlp.fc2.weight)


def test_unsupported_timm_models_are_refused_clearly():
    with pytest.raises(ValueError, match="ParallelScalingBlock blocks, which vitpe.VisionTransformer does not have"):
        vitpe.vit_from_timm(timm.create_model("vit_base_patch16_xp_224", depth=1))
    with pytest.raises(ValueError, match="HybridEmbed stem"):
        vitpe.vit_from_timm(timm.create_model("vit_tiny_r_s16_p8_224", depth=1))
    with pytest.raises(ValueError, match="not a Linear"):
        vitpe.vit_from_timm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="expected a timm VisionTransformer"):
        vitpe.equip_timm_vit(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="patch_drop_rate"):
        vitpe.equip_timm_vit(timm_vit(patch_drop_rate=0.5))
    t = vitpe.equip_timm_vit(timm_vit(), "rope_mixed")
    with pytest.raises(ValueError, match="already equipped"):
        vitpe.equip_timm_vit(t, "cpb")
    with pytest.raises(RuntimeError, match="run it through the model"):
        t.blocks[0](torch.randn(1, 5, 192))
    with pytest.raises(ValueError, match="no attn_mask"):
        t.blocks[0].attn(torch.randn(1, 5, 192), attn_mask=torch.zeros(5, 5))


def test_equipped_learned_pe_keeps_the_timm_function():
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
    t = vitpe.equip_timm_vit(timm_vit(), pe).train()
    for size in [(224, 224), (448, 448), (224, 320)]:
        out = t(torch.randn(2, 3, *size))
        assert out.shape == (2, 7) and torch.isfinite(out).all()
    out.square().mean().backward()
    pe_params = list(t.vitpe_pos_embed.parameters())
    assert all(p.grad is not None for p in pe_params)


def _twins(pe):
    """A timm ViT equipped with ``pe`` and the vitpe ViT with the same weights, PE parameters made large."""
    t = timm_vit(reg_tokens=1)
    v = vitpe.vit_from_timm(t, pos_embed=pe)
    vitpe.equip_timm_vit(t, pe)
    with torch.no_grad():
        for p in v.pos_embed.parameters():
            p.mul_(10)
    t.vitpe_pos_embed.load_state_dict(v.pos_embed.state_dict())
    return t, v


@pytest.mark.parametrize("pe", ["rope_mixed", "rel_bias+rope_mixed", "learned+peg", "cpb"])
def test_every_forward_path_of_an_equipped_timm_vit_runs_the_pe(pe):
    t, v = _twins(pe)
    x = torch.randn(2, 3, 320, 256)
    close = partial(torch.testing.assert_close, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        close(t(x), v(x))
        ft, fv = t.forward_features(x), v.forward_features(x)
        close(ft, fv)
        close(t.forward_head(ft), v.forward_head(fv))
        close(t.forward_head(ft, pre_logits=True), v.forward_head(fv, pre_logits=True))
        for kw in [dict(indices=[0, 1]), dict(indices=1, norm=True), dict(indices=[0], output_fmt="NLC", return_prefix_tokens=True)]:
            final_t, inter_t = t.forward_intermediates(x, **kw)
            final_v, inter_v = v.forward_intermediates(x, **kw)
            close(final_t, final_v)
            close(inter_t, inter_v)
        assert inter_v[0][0].shape == (2, 320, 192) and inter_v[0][1].shape == (2, 2, 192)  # patches, prefix
        maps = v.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        assert [m.shape for m in maps] == [(2, 192, 20, 16)] * 2
        close(list(t.get_intermediate_layers(x, n=2, reshape=True)), maps)
        # Without the PE the timm path would differ: the comparison can fail.
        assert (t.forward_features(x) - v.forward_features(x.flip(-1))).abs().max() > 1e-2


@pytest.mark.parametrize("pe", ["rope_mixed", "learned+rel_bias"])
def test_features_only_timm_model_equipped_with_a_pe(pe):
    t, v = _twins(pe)
    f = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, reg_tokens=1, features_only=True, out_indices=(0, 1))
    f.model.load_state_dict(t.state_dict(), strict=False)  # the same weights, pruned of head and norm
    assert vitpe.equip_timm_vit(f, pe) is f
    f.model.vitpe_pos_embed.load_state_dict(v.pos_embed.state_dict())
    f.model.cls_token.data.copy_(t.cls_token)  # carries the folded class-token position
    f.model.reg_token.data.copy_(t.reg_token)
    x = torch.randn(1, 3, 192, 288)
    with torch.no_grad():
        torch.testing.assert_close(f(x), v.forward_intermediates(x, indices=[0, 1], intermediates_only=True), atol=1e-4, rtol=1e-4)


def test_equipped_timm_vit_matches_vitpe_vit_with_the_same_weights_under_ema_copies():
    import copy

    t, v = _twins("rel_bias+rope_mixed")
    ema = copy.deepcopy(t)  # timm's ModelEmaV3 deep-copies: the copy must run its own PE
    x = torch.randn(1, 3, 320, 256)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), v(x), atol=1e-4, rtol=1e-4)
        assert ema._vitpe_state is not t._vitpe_state and ema.blocks[0].attn._vitpe_state is ema._vitpe_state


# ---- RoPE-ViT (timm's Eva ports of naver-ai/rope-vit) ---------------------------------------------------
def rope_vit(name, **kw):
    kw = {"pretrained": False, "depth": 2, "img_size": 32, "patch_size": 4, "embed_dim": 64, "num_heads": 4, "num_classes": 5,
          "dynamic_img_size": True, **kw}
    m = timm.create_model(name, **kw).eval()
    with torch.no_grad():  # random init: make every part matter
        if m.pos_embed is not None:
            m.pos_embed.normal_(std=0.5)
        for b in m.blocks:
            b.gamma_1.fill_(0.5), b.gamma_2.fill_(0.5)
        m.head.weight.normal_()
    return m


@pytest.mark.parametrize("name", ["vit_small_patch16_rope_mixed_ape_224", "vit_small_patch16_rope_mixed_224"])
@pytest.mark.parametrize("reference", ["timm", "rope-vit"])
def test_rope_vit_models_load_with_the_reference_logits_at_every_size(name, reference, monkeypatch):
    """timm's port resizes the table with antialiasing; naver-ai/rope-vit's own code with plain bicubic."""
    import timm.models.eva as eva

    e = rope_vit(name)
    ape = "ape" in name
    if reference == "rope-vit":
        no_antialias(monkeypatch, eva)
        modes = {"learned.coord_mode": "interpolate", "rope_mixed.coord_mode": "extrapolate"} if ape else {"coord_mode": "extrapolate"}
        v = vitpe.vit_from_timm(e, pos_embed_kwargs={**modes, **({"learned.antialias": False} if ape else {})})
    else:
        v = vitpe.vit_from_timm(e)
    assert v.pos_embed.name == ("learned+rope_mixed" if ape else "rope_mixed")
    with torch.no_grad():
        for size in [(32, 32), (48, 48), (64, 64), (24, 40), (16, 16)]:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(v.forward_features(x), e.forward_features(x), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v(x), e(x), atol=1e-4, rtol=1e-4)
    if ape and reference == "rope-vit":  # one coordinate mode for both parts (the old behaviour) misses the reference
        x = torch.randn(2, 3, 48, 48)
        for mode in COORD_MODES:
            w = vitpe.vit_from_timm(e, pos_embed="learned+rope_mixed", coord_mode=mode)
            with torch.no_grad():
                assert (w(x) - e(x)).abs().max() > 1e-3  # the right modes match to ~1e-5


# ---- Swin -----------------------------------------------------------------------------------------------
def _swin_bias(attn):
    n = attn.window_size[0] * attn.window_size[1]
    table = attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads)
    return 16 * torch.sigmoid(table[attn.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1))


def test_swinv2_cpb_loads_with_the_reference_bias_at_its_window_and_others():
    from timm.models.swin_transformer_v2 import WindowAttention

    a = WindowAttention(dim=32, window_size=(4, 6), num_heads=4, pretrained_window_size=(4, 6))
    with torch.no_grad():
        for p in a.cpb_mlp.parameters():
            p.normal_(std=0.5)  # the (dy, dx) -> (dx, dy) swap matters only when the columns differ
    pe = vitpe.cpb_from_swinv2(a)
    with torch.no_grad():
        for window in [(4, 6), (7, 5), (8, 12)]:
            a.set_window_size(window)
            grid = vitpe.PatchGrid.create(window, (4, 6), "interpolate")  # the model's mode; cpb keeps its own
            torch.testing.assert_close(pe.context(grid).bias, _swin_bias(a), atol=1e-5, rtol=1e-5)


def test_swin_relative_bias_table_loads_into_rel_bias():
    from timm.models.swin_transformer import WindowAttention

    a = WindowAttention(dim=32, num_heads=4, window_size=(3, 5))
    with torch.no_grad():
        a.relative_position_bias_table.normal_()
    pe = vitpe.build_pos_embed("rel_bias", dim=32, num_heads=4, ref_grid=(3, 5))
    pe.load_state_dict(pe.from_timm(dict(a.named_parameters())))
    torch.testing.assert_close(pe.bias(vitpe.PatchGrid.create((3, 5))), a._get_rel_pos_bias()[0])


# ---- vitpe in timm's registry ---------------------------------------------------------------------------
def test_vitpe_models_in_timms_registry():
    names = timm.list_models("vitpe_*")
    assert "vitpe_small_patch16_224_rope_mixed" in names and "vitpe_cifar_patch4_32_cpb" in names
    m = timm.create_model("vitpe_cifar_patch4_32_rope_mixed", num_classes=3, depth=2)
    assert isinstance(m, vitpe.VisionTransformer) and m.pos_embed.name == "rope_mixed" and len(m.blocks) == 2
    assert m(torch.randn(2, 3, 48, 32)).shape == (2, 3)
    combo = timm.create_model("vitpe_cifar_patch4_32", pos_embed="learned+rope_mixed", depth=1)
    assert combo.pos_embed.name == "learned+rope_mixed"
    f = timm.create_model("vitpe_cifar_patch4_32_peg", features_only=True, out_indices=(1, 3))
    maps = f(torch.randn(2, 3, 48, 32))
    assert [m.shape for m in maps] == [(2, 192, 12, 8)] * 2 and f.feature_info.channels() == [192, 192]
    assert len(f.model.blocks) == 4  # pruned after the last block asked for


@pytest.mark.parametrize("code", [
    "import sys, vitpe.pos_embed, vitpe; assert 'timm' not in sys.modules and 'torchvision' not in sys.modules",
    "import vitpe, timm; assert timm.create_model('vitpe_cifar_patch4_32_cpb', depth=1).pos_embed.name == 'cpb'",
    "import timm, vitpe; assert timm.create_model('vitpe_cifar_patch4_32_cpb', depth=1).pos_embed.name == 'cpb'",
])
def test_vitpe_imports_without_timm_and_registers_with_it_in_either_order(code):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
