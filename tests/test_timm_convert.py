"""timm's ViTs as vitpe models (vitpe.vit_from_timm): the same tokens and outputs as timm at the model's own size and,
through vitpe's coordinates, at a larger non-square size against timm's own dynamic-size path. One model per variant
(two blocks each, weights perturbed so that every part counts); benchmarks/timm_coverage.py measures all of timm's."""
import pytest
import timm
import torch

import vitpe

VARIANTS = {
    "deit_tiny_distilled_patch16_224": "distillation token and its head",
    "deit3_small_patch16_224": "LayerScale, table without the class token",
    "vit_base_patch32_clip_224": "CLIP: pre-norm, no patch bias",
    "vit_base_patch16_clip_quickgelu_224": "QuickGELU",
    "vit_base_patch16_siglip_224": "SigLIP: attention-pool head, tanh GELU, no class token",
    "vit_base_patch16_reg4_gap_256": "registers, mean pool, fc_norm",
    "eva02_tiny_patch14_224": "EVA-02: SwiGLU (packed), q/v biases, RoPE from patch corners",
    "eva02_base_patch16_clip_224": "EVA-02 CLIP: separate q/k/v, SwiGLU with sub-LN, attention sub-LN, RoPE stretched 16/14",
    "vit_small_patch16_dinov3": "DINOv3: RoPE in [-1, 1] on half-split pairs, registers, LayerScale, no qkv bias",
    "vit_small_patch16_dinov3_qkvb": "DINOv3 with q/v biases",
    "vit_pe_core_tiny_patch16_384": "Perception Encoder: RoPE from 1, attention pool over every token, 8 pool heads",
    "vit_base_patch16_sapiens2": "sapiens2: RMSNorm, qk-norm, LayerScale on attention only, GLU",
    "vit_small_patch16_rope_mixed_ape_224": "RoPE-ViT: mixed frequencies and a table",
    "vit_base_patch16_rpn_224": "res-post-norm blocks",
    "vit_small_patch16_rope_ape_224": "RoPE-ViT axial with a table: the RoPE extrapolated, the table resized",
}
ONE_SIZE = {  # timm runs these at their own size only: vitpe's outputs there, and vitpe alone at new sizes
    "vit_relpos_small_patch16_224": "relative-position MLP per block, fc_norm, no qkv bias",
    "vit_srelpos_small_patch16_224": "one relative-position MLP shared by the blocks",
    "vit_relpos_small_patch16_rpn_224": "relative position with res-post-norm blocks",
}


SMALLER = {"vit_base_patch16_sapiens2": {"img_size": (128, 96)}}  # its per-block head counts fix its depth: a smaller image


def perturbed(name, **kw):
    if name not in timm.list_models(name):
        pytest.skip(f"this timm ({timm.__version__}) has no {name}")
    kw = {**(SMALLER.get(name) or {"depth": 2}), **({} if name in ONE_SIZE else {"dynamic_img_size": True}), **kw}
    m = timm.create_model(name, pretrained=False, **kw).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random init leaves LayerScale, heads and latents near zero: make every weight matter
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_converted_timm_model_computes_what_timm_computes_at_its_size_and_at_a_new_one(name):
    t = perturbed(name)
    v = vitpe.vit_from_timm(t)
    h, w = t.patch_embed.img_size
    p = t.patch_embed.patch_size[0]
    torch.manual_seed(0)
    x, x2 = torch.randn(2, 3, h, w), torch.randn(1, 3, h + 2 * p, w + 4 * p)
    with torch.no_grad():
        a, b = t.forward_features(x), v.forward_features(x)
        assert rel(b, a) <= 1e-4, VARIANTS[name]
        assert rel(v.forward_head(b), t.forward_head(a)) <= 1e-4
        assert rel(v(x2), t(x2)) <= 1e-4, f"{VARIANTS[name]}: not timm's dynamic-size output at {tuple(x2.shape[-2:])}"


@pytest.mark.parametrize("name", list(ONE_SIZE))
def test_timms_relative_position_vits_convert_and_meet_new_sizes_through_vitpes_offsets(name):
    t = perturbed(name)
    v = vitpe.vit_from_timm(t)
    assert v.pos_embed.name == "cpb"
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert rel(v(x), t(x)) <= 1e-4, ONE_SIZE[name]
        y = v(torch.randn(1, 3, 256, 320))  # timm refuses this size; vitpe evaluates the MLP at the new offsets
    assert y.shape == (1, t.num_classes) and torch.isfinite(y).all()


NAFLEX = {  # NaFlexVit at a narrow width: its table on a 16x16 grid, timm's default input 384 px, so resized even there
    "naflexvit_base_patch16_gap": "2D table, bicubic with antialiasing, registers, mean pool, fc_norm",
    "naflexvit_base_patch16_par_gap": "2D table resized to a square of the longer side, read from the top left",
    "naflexvit_base_patch16_parfac_gap": "factorized tables (NaViT), aspect-preserving",
    "naflexvit_base_patch16_siglip": "bilinear table, attention pool",
    "naflexvit_base_patch16_radio_v3": "C-RADIOv3: a 128x128 table shrunk bilinearly with aligned corners, class token",
}


@pytest.mark.parametrize("name", list(NAFLEX))
def test_naflexvit_converts_with_its_linear_stem_and_its_tables_resized_as_timm_resizes_them(name):
    if name not in timm.list_models(name):
        pytest.skip(f"this timm ({timm.__version__}) has no {name}")
    t = timm.create_model(name, pretrained=False, depth=2, embed_dim=96, num_heads=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    v = vitpe.vit_from_timm(t)
    assert v.pos_embed.name == ("factorized" if "parfac" in name else "learned")
    for hw in [(384, 384), (256, 256), (224, 320), (320, 176)]:  # timm's default, the table's own grid, wide, tall
        x = torch.randn(2, 3, *hw, generator=g)
        with torch.no_grad():
            assert rel(v(x), t(x)) <= 1e-4, f"{NAFLEX[name]} at {hw}"


def test_factorized_tables_are_navits_sum_of_per_axis_tables_resampled_linearly():
    pe = vitpe.build_pos_embed("factorized", dim=8, num_heads=2, ref_grid=(4, 6))
    y, x = pe.table_y.detach(), pe.table_x.detach()
    assert torch.equal(pe.tokens(vitpe.PatchGrid.create((4, 6), (4, 6))), (y[:, None] + x[None, :]).reshape(24, 8))

    def resized(t, n):
        return torch.nn.functional.interpolate(t.t()[None], size=n, mode="linear", align_corners=False)[0].t()

    want = (resized(y, 7)[:, None] + resized(x, 3)[None, :]).reshape(21, 8)
    assert torch.allclose(pe.tokens(vitpe.PatchGrid.create((7, 3), (4, 6))), want, atol=1e-6)
    sq = vitpe.build_pos_embed("factorized", dim=8, num_heads=2, ref_grid=(4, 6), square=True)
    sq.load_state_dict(pe.state_dict())
    want = (resized(y, 5)[:3, None] + resized(x, 5)[None, :5]).reshape(15, 8)  # a square of the longer side, its corner
    assert torch.allclose(sq.tokens(vitpe.PatchGrid.create((3, 5), (4, 6))), want, atol=1e-6)
    with pytest.raises(ValueError, match="needs one plain interpolate-mode grid"):
        sq.tokens(vitpe.PatchGrid.create((3, 5), (4, 6), "extrapolate"))


def test_a_converted_model_takes_vitpes_controls_at_new_sizes():
    t = perturbed("vit_small_patch16_dinov3")
    v = vitpe.vit_from_timm(t)
    assert v.pos_embed.name == "rope_axial" and v.coord_mode == "normalize"  # the model's mode: eval.py --coord-mode moves it
    x = torch.randn(1, 3, 384, 256)
    with torch.no_grad():
        before = v(x)
        v.coord_mode = "extrapolate"  # the same weights in another frame: a different function
        assert rel(v(x), before) > 1e-3
    swapped = vitpe.vit_from_timm(t, pos_embed="rope_mixed")  # another PE keeps timm's channel order and every other weight
    torch.testing.assert_close(swapped.blocks[0].attn.qkv.weight, t.blocks[0].attn.qkv.weight)


def test_timm_rope_pairs_become_vitpes_by_one_permutation_of_q_and_k():
    from vitpe.timm.convert import _pair_perm

    for half in (True, False):
        for y_first in (True, False):
            perm = _pair_perm(16, y_first=y_first, half=half)
            assert sorted(perm.tolist()) == list(range(16))  # a permutation: every q . k kept
    # DINOv3 (y bands first, pairs (i, i + 8)): vitpe's first pair (x, band 0) is timm's pair 4 = channels (4, 12)
    assert _pair_perm(16, y_first=True, half=True)[:2].tolist() == [4, 12]
    # EVA-02 (y first, interleaved): vitpe's x band 0 is timm's pair 4 = channels (8, 9)
    assert _pair_perm(16, y_first=True, half=False)[:2].tolist() == [8, 9]


def test_what_vitpe_lacks_is_named_in_one_line():
    with pytest.raises(ValueError, match=r"^this timm model uses ParallelThingsBlock blocks, which vitpe.VisionTransformer does not have$"):
        vitpe.vit_from_timm(timm.create_model("vit_small_patch16_18x2_224", depth=1))
    with pytest.raises(ValueError, match=r"^vit_from_timm takes timm's VisionTransformer, .* not a ResNet$"):
        vitpe.vit_from_timm(timm.create_model("resnet18"))


def test_what_vit_from_timm_does_not_reproduce_is_refused_naming_it():
    """Once converted silently with logits 14% off: a ViT whose MLP activation was swapped in one block. A custom or
    bias-free head, a features_only model and a vitpe model get a line that says what is unsupported and what to do."""
    from torch import nn

    def tiny(**kw):
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, **kw).eval()

    for block in (0, 1):
        m = tiny()
        m.blocks[block].mlp.act = nn.ReLU()
        with pytest.raises(ValueError, match="a ReLU activation" if block == 0 else "block 1 unlike block 0"):
            vitpe.vit_from_timm(m)
    m = tiny()
    m.head = nn.Sequential(nn.Linear(192, 10))
    with pytest.raises(ValueError, match="a Sequential head .*reset_classifier"):
        vitpe.vit_from_timm(m)
    m = tiny()
    m.head = nn.Linear(192, 10, bias=False)
    with pytest.raises(ValueError, match="a head without bias"):
        vitpe.vit_from_timm(m)
    with pytest.raises(ValueError, match="features_only model .*build it without|features_only model .*without features_only=True"):
        vitpe.vit_from_timm(timm.create_model("vit_tiny_patch16_224", pretrained=False, features_only=True))
    with pytest.raises(ValueError, match="already a vitpe.VisionTransformer: use it as it is"):
        vitpe.vit_from_timm(vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2))
    assert vitpe.vit_from_timm(tiny(num_classes=0)).num_classes == 0  # no head at all is timm's own, and converts
