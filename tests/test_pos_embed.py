"""Every registered encoding: registry contract, resolution transfer, caching, and that order matters."""
import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_PE

import vitpe
from vitpe.pos_embed import functional as PF
from vitpe.pos_embed.bias import log_spaced

FAMILIES = ["none", "sincos2d", "fourier", "fourier_learned", "learned", "factorized", "rel_bias", "cpb", "fire", "lookhere", "alibi2d", "pape",
            "rope_axial",
            "rope_mixed", "rope_golden", "string", "liere", "comrope", "peg"]


def small_vit(pe, img=256, patch=16, **kw):
    kw = {"embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 5, **kw}
    return vitpe.VisionTransformer(img_size=img, patch_size=patch, pos_embed=pe, **kw)


def test_registry_lists_every_family_in_order():
    assert vitpe.list_pos_embeds() == FAMILIES


def test_every_family_documents_its_paper_and_what_it_acts_on():
    for name in FAMILIES:
        pe = vitpe.build_pos_embed(name, dim=32, num_heads=2, ref_grid=4)
        assert type(pe).__doc__ and len(type(pe).__doc__) > 60
        assert name == "none" or pe.acts_on != "-"


def test_unknown_name_and_option_raise_value_error_naming_valid_ones():
    with pytest.raises(ValueError, match="valid names: none, sincos2d"):
        vitpe.build_pos_embed("sincos3d", dim=32, num_heads=2, ref_grid=4)
    with pytest.raises(ValueError, match="valid options: cell_offset, coord_mode, max_period, min_period, offset, p_rope, scaling, theta"):
        vitpe.build_pos_embed("rope_axial", dim=32, num_heads=2, ref_grid=4, temperature=10)
    with pytest.raises(ValueError, match=r"unknown positional encoding 'rope_mixd' \(did you mean 'rope_mixed'\?\)"):
        vitpe.build_pos_embed("rope_mixd", dim=32, num_heads=2, ref_grid=4)
    with pytest.raises(ValueError, match=r"did you mean 'theta'\?"):
        vitpe.build_pos_embed("rope_axial", dim=32, num_heads=2, ref_grid=4, thetta=10)
    with pytest.raises(ValueError, match=r"not a coordinate mode \(did you mean 'extrapolate'\?\)"):
        vitpe.build_pos_embed("learned+rope_mixed", dim=32, num_heads=2, ref_grid=4, **{"rope_mixed.coord_mode": "extrapolation"})
    with pytest.raises(ValueError, match="rope_mixed.theta"):
        vitpe.build_pos_embed("sincos2d+rope_mixed", dim=32, num_heads=2, ref_grid=4, nope=1)
    with pytest.raises(ValueError, match="at most one rotary"):
        vitpe.build_pos_embed("rope_axial+rope_mixed", dim=32, num_heads=2, ref_grid=4)
    with pytest.raises(ValueError, match="unknown positional encoding"):
        vitpe.VisionTransformer(img_size=32, patch_size=8, pos_embed="alibi")


def test_options_route_to_the_parts_of_a_combination():
    pe = vitpe.build_pos_embed("sincos2d+rope_mixed", dim=32, num_heads=2, ref_grid=4, theta=3.0, base=50.0, **{"rope_mixed.per_layer": False})
    sincos, rope = pe.parts
    assert sincos.base == 50.0 and rope.theta == 3.0 and rope.per_layer is False


@pytest.mark.parametrize("pe", ALL_PE)
def test_runs_forward_and_backward_at_new_resolutions(pe):
    model = small_vit(pe)
    for size in [(256, 256), (512, 512), (256, 384)]:
        for mode in vitpe.COORD_MODES:
            model.coord_mode = mode
            model.zero_grad()
            out = model(torch.randn(2, 3, *size))
            assert out.shape == (2, 5) and torch.isfinite(out).all()
            out.square().mean().backward()
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            assert all(g is not None and torch.isfinite(g).all() for g in grads)


def _encodings(pe, grid):
    """Everything the encoding contributes on ``grid``, as plain tensors."""
    ctx = pe.context(grid)
    parts = (("tokens", ctx.tokens), ("bias", ctx.bias), ("cos", ctx.cos), ("sin", ctx.sin), ("mats", ctx.mats), ("mix", ctx.mix))
    out = {k: v for k, v in parts if v is not None}
    if ctx.extenders:  # features computed from the tokens: the same tokens on both grids
        n = grid.coords.shape[-2]
        x = torch.randn(1, n, pe.dim, generator=torch.Generator().manual_seed(n))
        q, k, _ = ctx.extend(torch.zeros(1, pe.num_heads, n, 1), torch.zeros(1, pe.num_heads, n, 1), x, 0)
        out.update(extra_q=q, extra_k=k)
    return out


@pytest.mark.parametrize("pe_name", [p for p in ALL_PE if p != "none" and p != "peg"])
@pytest.mark.parametrize("mode", ["interpolate", "extrapolate"])
def test_new_grid_is_the_same_continuous_function_at_new_coordinates(pe_name, mode):
    """Canonical-grid shortcuts (lattice offsets, caches) must not change the function: evaluating the
    encoding at the same coordinates given as arbitrary points gives the same values."""
    pe = vitpe.build_pos_embed(pe_name, dim=32, num_heads=2, ref_grid=(16, 16), depth=2)
    for size in [(32, 32), (16, 24), (8, 8)]:
        canonical = vitpe.PatchGrid.create(size, (16, 16), mode)
        arbitrary = vitpe.PatchGrid.from_coords(canonical.coords.clone(), size, (16, 16))
        a, b = _encodings(pe, canonical), _encodings(pe, arbitrary)
        assert a.keys() == b.keys() and a
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def test_sincos_and_fourier_tokens_are_their_formulas_at_any_grid():
    for name, fn in [("sincos2d", lambda pe, c: vitpe.sincos_2d(c, 32)), ("fourier", lambda pe, c: vitpe.fourier_features(c, pe.freqs))]:
        pe = vitpe.build_pos_embed(name, dim=32, num_heads=2, ref_grid=16)
        for size in [16, 32, (16, 24)]:
            g = vitpe.PatchGrid.create(size, 16)
            torch.testing.assert_close(pe.tokens(g), fn(pe, vitpe.grid_coords(size, 16)))


def test_learned_is_exact_at_reference_and_bicubic_interpolate_elsewhere():
    pe = vitpe.build_pos_embed("learned", dim=32, num_heads=2, ref_grid=16)
    assert torch.equal(pe.tokens(vitpe.PatchGrid.create(16, 16)), pe.table.flatten(2)[0].t())
    for size in [(32, 32), (16, 24), (8, 8), (11, 5)]:
        ours = pe.tokens(vitpe.PatchGrid.create(size, 16, "interpolate"))
        ref = F.interpolate(pe.table, size=size, mode="bicubic", align_corners=False).flatten(2)[0].t()
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    # Extrapolate mode at a smaller grid is a crop of the table.
    crop = pe.tokens(vitpe.PatchGrid.create(8, 16, "extrapolate"))
    torch.testing.assert_close(crop, pe.table[:, :, :8, :8].flatten(2)[0].t(), atol=1e-5, rtol=1e-5)


def test_rel_bias_is_swin_at_reference_and_samples_table_elsewhere():
    pe = vitpe.build_pos_embed("rel_bias", dim=32, num_heads=2, ref_grid=(4, 5))
    ref_bias = pe.bias(vitpe.PatchGrid.create((4, 5)))
    assert torch.equal(ref_bias, pe.table[vitpe.relative_position_index((4, 5))].permute(2, 0, 1))
    # Extrapolate to a larger grid: offsets inside the table are exact entries, beyond it the border value.
    big = pe.bias(vitpe.PatchGrid.create((6, 7), (4, 5), "extrapolate"))  # (H, 42, 42)
    table = pe.table.t().reshape(2, 7, 9)  # (H, 2h-1, 2w-1), row = dy + 3, col = dx + 4
    q, k = 0, 2 * 7 + 3  # q at (y=0, x=0), k at (y=2, x=3): dy=-2, dx=-3
    torch.testing.assert_close(big[:, q, k], table[:, -2 + 3, -3 + 4], atol=1e-5, rtol=1e-5)
    q, k = 5 * 7 + 6, 0  # dy=5, dx=6 beyond the table: clamped to (dy=3, dx=4)
    torch.testing.assert_close(big[:, q, k], table[:, 6, 8], atol=1e-5, rtol=1e-5)


def test_cpb_is_swin_v2_at_reference():
    pe = vitpe.build_pos_embed("cpb", dim=32, num_heads=2, ref_grid=(4, 4))
    table = log_spaced(PF.lattice_offsets((4, 4), (1.0, 1.0)), (4, 4))
    expected = 16 * torch.sigmoid(pe.mlp(table).flatten(0, 1)[vitpe.relative_position_index(4)]).permute(2, 0, 1)
    torch.testing.assert_close(pe.bias(vitpe.PatchGrid.create(4)), expected)
    assert pe.bias(vitpe.PatchGrid.create(4)).min() > 0  # 16 * sigmoid is in (0, 16)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_rope_angles_are_linear_in_coordinates(name):
    pe = vitpe.build_pos_embed(name, dim=32, num_heads=2, ref_grid=8, depth=3)
    fine = vitpe.PatchGrid.create(16, 8)
    angles = pe.rope_angles(fine)
    freqs = pe.freqs
    expected = PF.rope_angles(fine.coords, freqs)
    torch.testing.assert_close(angles, expected)
    if name == "rope_mixed":
        assert angles.shape == (3, 2, 256, 8)  # per layer, per head


def test_fixed_tables_are_cached_and_learned_ones_rebuilt_while_training():
    fixed = vitpe.build_pos_embed("sincos2d+rope_axial", dim=32, num_heads=2, ref_grid=8)
    g = vitpe.PatchGrid.create(8)
    assert fixed.context(g, 1) is fixed.context(vitpe.PatchGrid.create(8), 1)

    learned = vitpe.build_pos_embed("rel_bias", dim=32, num_heads=2, ref_grid=8)
    a = learned.context(g)
    assert a.bias.requires_grad and learned.context(g) is not a  # training: fresh graph every step
    with torch.no_grad():
        b = learned.context(g)
        assert learned.context(g) is b  # inference: cached
        learned.table.add_(1.0)  # an optimizer step changes the parameters...
        c = learned.context(g)
    assert c is not b and torch.allclose(c.bias, b.bias + 1)  # ...and the stale table is not reused


def test_prefix_tokens_get_no_position_and_do_not_shift_the_grid():
    pe = vitpe.build_pos_embed("sincos2d+rel_bias+rope_axial", dim=32, num_heads=2, ref_grid=4)
    g = vitpe.PatchGrid.create(4)
    c0, c3 = pe.context(g, 0), pe.context(g, 3)
    torch.testing.assert_close(c3.bias[:, 3:, 3:], c0.bias)
    assert torch.all(c3.bias[:, :3, :] == 0) and torch.all(c3.bias[:, :, :3] == 0)
    torch.testing.assert_close(c3.cos[..., 3:, :], c0.cos)
    assert torch.all(c3.cos[..., :3, :] == 1) and torch.all(c3.sin[..., :3, :] == 0)
    torch.testing.assert_close(c3.tokens, c0.tokens)


@pytest.mark.parametrize("pe", ALL_PE)
def test_order_matters_exactly_when_there_is_a_positional_encoding(pe):
    model = small_vit(pe, img=32, patch=8, class_token=False, pool="mean").eval()
    with torch.no_grad():  # at init attention is near uniform and bias tables near zero: give both a trained scale
        # (PaPE's parabolas, 20x steeper, would make each patch attend to itself alone: order-blind, like no attention)
        scaled = [p for n, p in model.pos_embed.named_parameters() if "coefficients" not in n and "position." not in n]
        for p in scaled + [b.attn.qkv.weight for b in model.blocks]:
            p.mul_(20)
    x = torch.randn(2, 3, 32, 32)
    patches = x.unfold(2, 8, 8).unfold(3, 8, 8)  # (B, C, 4, 4, 8, 8)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    shuffled = patches.flatten(2, 3)[:, :, perm].unflatten(2, (4, 4)).permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 32, 32)
    with torch.no_grad():
        a, b = model(x), model(shuffled)
    if pe == "none":
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:
        assert (a - b).abs().max() > 1e-3 * a.abs().max()


def test_each_part_of_a_combination_reads_its_own_coordinate_mode():
    """RoPE-ViT's "+APE": the table interpolates, RoPE extrapolates, whatever mode the model's grid is in."""
    kw = dict(dim=32, num_heads=2, ref_grid=4)
    pe = vitpe.build_pos_embed("learned+rope_mixed", **kw, **{"learned.coord_mode": "interpolate", "rope_mixed.coord_mode": "extrapolate"})
    learned, rope = pe.parts
    assert learned.coord_mode == "interpolate" and rope.coord_mode == "extrapolate"
    for model_mode in vitpe.COORD_MODES:
        grid = vitpe.PatchGrid.create((6, 5), 4, model_mode)
        ctx = pe.context(grid)
        torch.testing.assert_close(ctx.tokens, learned.tokens(vitpe.PatchGrid.create((6, 5), 4, "interpolate")))
        angles = rope.rope_angles(vitpe.PatchGrid.create((6, 5), 4, "extrapolate"))
        torch.testing.assert_close(ctx.cos, angles.cos())
    # Augmented coordinates keep their augmentation in the part's own mode.
    aug = vitpe.PatchGrid.create((6, 5), 4, "interpolate").transformed(1.5, 0.8, 0.3, -0.2)
    expected = vitpe.PatchGrid.create((6, 5), 4, "extrapolate").transformed(1.5, 0.8, 0.3, -0.2).coords
    torch.testing.assert_close(aug.in_mode("extrapolate").coords, expected)
    # A mode on one part changes the result, so the test above can fail.
    same = vitpe.build_pos_embed("learned+rope_mixed", **kw)
    same.load_state_dict(pe.state_dict())
    assert not torch.allclose(same.context(vitpe.PatchGrid.create((6, 5), 4)).cos, pe.context(vitpe.PatchGrid.create((6, 5), 4)).cos)
    with pytest.raises(ValueError, match="needs a grid made by PatchGrid.create"):
        rope.own_grid(vitpe.PatchGrid.from_coords(torch.rand(30, 2), (6, 5), 4))


def test_learned_antialias_resizes_as_timm_does():
    from timm.layers import resample_abs_pos_embed

    pe = vitpe.build_pos_embed("learned", dim=8, num_heads=2, ref_grid=(4, 6), antialias=True)
    for size in [(7, 9), (3, 4)]:
        expected = resample_abs_pos_embed(pe.table.flatten(2).transpose(1, 2), list(size), [4, 6], num_prefix_tokens=0)[0]
        torch.testing.assert_close(pe.tokens(vitpe.PatchGrid.create(size, (4, 6))), expected)
    with pytest.raises(ValueError, match="needs one plain interpolate-mode grid per batch; got coord mode extrapolate"):
        pe.tokens(vitpe.PatchGrid.create((7, 9), (4, 6), "extrapolate"))


def test_learned_takes_the_other_resizes_timms_models_use():
    """Bilinear (SigLIP), aligned corners (C-RADIOv3) and NaFlex's aspect-preserving square, each what F.interpolate gives."""
    F = torch.nn.functional
    for opts in [dict(mode="bilinear"), dict(mode="bilinear", align_corners=True), dict(square=True, antialias=True),
                 dict(mode="bilinear", square=True, align_corners=True)]:
        pe = vitpe.build_pos_embed("learned", dim=8, num_heads=2, ref_grid=(4, 6), **opts)
        for size in [(7, 9), (3, 4), (5, 2)]:
            out = max(size) if opts.get("square") else size
            table = F.interpolate(pe.table, size=out, mode=opts.get("mode", "bicubic"), antialias=opts.get("antialias", False),
                                  align_corners=opts.get("align_corners", False))[:, :, : size[0], : size[1]]
            torch.testing.assert_close(pe.tokens(vitpe.PatchGrid.create(size, (4, 6))), table.flatten(2)[0].t(), msg=str((opts, size)))
    with pytest.raises(ValueError, match="learned.mode must be 'bicubic' or 'bilinear', got 'nearest'"):
        vitpe.build_pos_embed("learned", dim=8, num_heads=2, ref_grid=4, mode="nearest")


def test_antialias_weights_are_pytorchs_antialiased_resize_as_a_matrix():
    """What an exported graph uses for timm's antialiased table resize (ONNX has no such operator): the same weights."""
    from vitpe.pos_embed.additive import antialias_weights

    F = torch.nn.functional
    t = torch.randn(1, 3, 7, 9)
    for mode in ("bicubic", "bilinear"):
        for size in [(14, 18), (3, 4), (7, 9), (10, 5)]:  # larger, smaller, the same, and both at once
            got = torch.einsum("yh,bdhw,xw->bdyx", antialias_weights(size[0], 7, mode), t, antialias_weights(size[1], 9, mode))
            torch.testing.assert_close(got, F.interpolate(t, size=size, mode=mode, antialias=True), atol=2e-6, rtol=1e-5)
