"""The 2024-26 families built for resolution transfer, and the conventions the field converged on: the papers' own
claims (relative q.k, orthogonality, what a bias depends on), exactness at the reference grid, DINOv3's normalised
frame and periods, and RoPE's extrapolation controls (PI, NTK, YaRN, p-RoPE) at build and evaluation time."""
import math

import pytest
import torch
import torch.nn.functional as F

import vitpe
from vitpe.pos_embed import functional as PF
from vitpe.pos_embed import set_lookhere_slope, set_rope_extrapolation
from vitpe.pos_embed.bias import fire_features
from vitpe.pos_embed.rotary import golden_directions, golden_rope_freqs, period_rope_freqs

ROTARY = ["rope_axial", "rope_mixed", "rope_golden", "string", "liere", "comrope"]
RELATIVE = [("rope_golden", {}), ("string", {}), ("comrope", {"variant": "ld"}), ("comrope", {"variant": "ap"}), ("liere", {"block_size": 2})]


def build(name, ref=(8, 8), depth=2, **opts):
    pe = vitpe.build_pos_embed(name, dim=64, num_heads=2, ref_grid=ref, depth=depth, **opts).double()
    with torch.no_grad():  # trained-looking parameters: a claim must hold for any, not only the initial ones
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe


def rotated_logits(pe, coords, ref=(8, 8), layer=0):
    torch.manual_seed(1)
    n = coords.shape[0]
    q, k = torch.randn(2, 1, 2, n, 32, dtype=torch.float64).unbind(0)
    grid = vitpe.PatchGrid.from_coords(coords, (1, n), ref)
    ctx = pe.context(grid, dtype=torch.float64)
    qr, kr = ctx.rotate(q, k, layer)
    return qr, kr, q, k, qr @ kr.transpose(-1, -2)


@pytest.mark.parametrize("name,opts", RELATIVE, ids=[f"{n}-{o}" for n, o in RELATIVE])
def test_rotary_attention_depends_only_on_the_offset(name, opts):
    torch.manual_seed(0)
    pe = build(name, **opts)
    coords = torch.rand(12, 2, dtype=torch.float64) * 8
    shifted = coords + torch.tensor([2.7, -1.3], dtype=torch.float64)
    torch.testing.assert_close(rotated_logits(pe, coords)[-1], rotated_logits(pe, shifted)[-1], atol=2e-5, rtol=1e-4)


def test_liere_with_larger_blocks_is_not_relative_which_the_test_above_would_catch():
    torch.manual_seed(0)
    pe = build("liere", block_size=8)
    coords = torch.rand(12, 2, dtype=torch.float64) * 8
    shifted = coords + torch.tensor([2.7, -1.3], dtype=torch.float64)
    assert (rotated_logits(pe, coords)[-1] - rotated_logits(pe, shifted)[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ROTARY)
def test_rotations_are_orthogonal(name):
    torch.manual_seed(0)
    pe = build(name)
    qr, kr, q, k, _ = rotated_logits(pe, torch.rand(10, 2, dtype=torch.float64) * 8)
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1), atol=1e-6, rtol=1e-6)
    mats = pe.context(vitpe.PatchGrid.create((3, 4), (8, 8)), dtype=torch.float64).mats
    if mats is not None:  # LieRE, ComRoPE: every block R^T R = I
        eye = torch.eye(mats.shape[-1], dtype=torch.float64)
        torch.testing.assert_close(mats.transpose(-1, -2) @ mats, eye.expand_as(mats), atol=1e-10, rtol=0)


def test_string_is_rope_between_an_orthogonal_matrix_and_folds_into_the_projections():
    torch.manual_seed(0)
    pe = build("string")
    p = pe.rope_mix()  # (H, hd, hd)
    torch.testing.assert_close(p @ p.transpose(-1, -2), torch.eye(32, dtype=torch.float64).expand_as(p), atol=1e-10, rtol=0)
    coords = torch.rand(9, 2, dtype=torch.float64) * 8
    *_, q, k, logits = rotated_logits(pe, coords)
    # Folded: P applied to q and k (as W_q, W_k would), then plain RoPE at the same frequencies.
    angles = PF.rope_angles(coords, pe.freqs)  # (H, N, P)
    fq, fk = PF.apply_rope(q @ p.transpose(-1, -2), angles), PF.apply_rope(k @ p.transpose(-1, -2), angles)
    torch.testing.assert_close(logits, fq @ fk.transpose(-1, -2), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        pe.generator.zero_()
    assert torch.equal(pe.rope_mix(), torch.eye(32, dtype=torch.float64).expand(2, 32, 32))  # S = 0: plain RoPE


def test_comrope_generators_commute_and_liere_generators_do_not():
    torch.manual_seed(0)
    for name, opts, commute in [("comrope", {"variant": "ld"}, True), ("comrope", {"variant": "ap"}, True), ("liere", {}, False)]:
        ax, ay = build(name, **opts).generators()
        gap = (ax @ ay - ay @ ax).abs().max().item()
        assert (gap < 1e-10) == commute, (name, opts, gap)


def test_golden_directions_are_unit_and_spread_around_the_circle():
    d = golden_directions(256)
    torch.testing.assert_close(d.norm(dim=-1), torch.ones(256))
    angles = torch.atan2(d[:, 1], d[:, 0])
    counts = torch.histc(angles, bins=8, min=-math.pi, max=math.pi)
    assert counts.min() > 0.5 * 256 / 8  # every octant is used: isotropic, not two axes
    freqs = golden_rope_freqs(32, 2, 0.01, 1.0)  # (2, H, P)
    mag = freqs.norm(dim=0)
    torch.testing.assert_close(mag[0], 0.01 * 100 ** torch.linspace(0, 1, 16), rtol=1e-5, atol=0)


# ---- biases: FIRE and LookHere ---------------------------------------------------------------------------------

def test_fire_bias_is_its_formula_and_depends_only_on_offset_and_normaliser():
    torch.manual_seed(0)
    pe = build("fire")
    for size, mode in [((8, 8), "interpolate"), ((16, 12), "extrapolate"), ((6, 10), "normalize")]:
        grid = vitpe.PatchGrid.create(size, (8, 8), mode)
        bias = pe.bias(pe.own_grid(grid))  # (H, N, N)
        offsets = vitpe.patch_units(PF.relative_offsets(grid.coords.double()), grid, offsets=True)
        extent = vitpe.patch_units(grid.extent().double(), grid, offsets=True)
        want = pe.mlp(fire_features(offsets, extent, pe.log_c.exp())).movedim(-1, 0)
        torch.testing.assert_close(bias, want, atol=2e-5, rtol=1e-4)
        inputs = fire_features(offsets, extent, pe.log_c.exp())
        assert inputs.abs().max() < 1  # a larger image is a denser range of inputs, never a wider one
    # Same offsets, other normaliser (a larger image in extrapolate mode): a different bias.
    small = pe.bias(vitpe.PatchGrid.create((8, 8), (8, 8), "extrapolate"))
    large = pe.bias(vitpe.PatchGrid.create((16, 16), (8, 8), "extrapolate"))
    assert (small[:, 0, 1] - large[:, 0, 1]).abs().max() > 1e-6  # offset (1, 0) in both
    # Translation: per-image coordinates shifted by any amount give the same bias.
    grid = vitpe.TokenGrid.from_grid(vitpe.PatchGrid.create((6, 6), (8, 8), "extrapolate"), 2)
    moved = grid.augmented(torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 3.5, -2.25]]))
    b = pe.bias(moved)
    torch.testing.assert_close(b[0], b[1], atol=2e-5, rtol=1e-4)


def test_lookhere_masks_fields_of_view_and_penalises_distance_by_layer():
    pe = vitpe.build_pos_embed("lookhere", dim=64, num_heads=8, ref_grid=(5, 5), depth=3)
    grid = vitpe.PatchGrid.create((5, 5), (5, 5))
    bias = pe.bias(grid)  # (L, H, N, N)
    assert bias.shape == (3, 8, 25, 25)
    centre, above, below, right = 12, 7, 17, 13
    # head 0 looks up: sees the key above (a penalty of slope * distance) and itself, not the key below
    assert torch.isinf(bias[0, 0, centre, below]) and bias[0, 0, centre, centre] == 0
    torch.testing.assert_close(bias[0, 0, centre, above], torch.tensor(-1.5 * 0.5 * 1.0))
    assert bias[0, 0, centre, right] == -1.5 * 0.5 * 1.0  # fov 180: the half-plane's edge is inside
    assert torch.isfinite(bias[0, 1, centre, below]) and torch.isinf(bias[0, 1, centre, above])  # head 1 looks down
    assert bias[0, 4, centre, above] == -1.5 * 0.25  # the second group of four heads: half the slope
    torch.testing.assert_close(bias[-1][torch.isfinite(bias[-1])] * 3, bias[0][torch.isfinite(bias[0])])  # 1.5 vs 0.5
    narrow = vitpe.build_pos_embed("lookhere", dim=64, num_heads=8, ref_grid=(5, 5), depth=3, fov=90).bias(grid)
    assert torch.isinf(narrow[0, 0, centre, right]) and torch.isfinite(narrow[0, 0, centre, centre - 6])  # up-left diagonal: inside
    # Only the offset matters: the same pattern for every query, shifted
    torch.testing.assert_close(bias[0, :, 6, 7], bias[0, :, 12, 13])
    for q_row in range(25):  # a query always sees itself: no attention row is empty
        assert torch.isfinite(bias[:, :, q_row, q_row]).all()


def test_lookhere_runs_in_a_model_with_the_layers_own_biases():
    model = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=3, pos_embed="lookhere")
    x = torch.randn(2, 3, 32, 32)
    _, pos = model.embed(x)
    assert pos.mask_per_layer and not torch.equal(pos.mask_at(0), pos.mask_at(2))
    logits = model.blocks[1].attn.attention_logits(model.blocks[1].norm1(model.embed(x)[0]), pos, 1)
    assert torch.isinf(logits).any() and torch.isfinite(logits[:, :, 0]).all()  # the class token sees everything


# ---- exact at the reference grid, and DINOv3's frame ------------------------------------------------------------

@pytest.mark.parametrize("name", ["fire", "lookhere", "rope_golden", "string", "liere", "comrope"])
def test_each_new_family_at_the_reference_grid_is_its_function_of_the_integer_lattice(name):
    torch.manual_seed(0)
    pe = build(name)
    ref = vitpe.PatchGrid.create((8, 8), (8, 8))
    lattice = vitpe.PatchGrid.from_coords(vitpe.grid_coords((8, 8)).clone(), (8, 8), (8, 8))
    a, b = pe.context(ref, dtype=torch.float64), pe.context(lattice, dtype=torch.float64)
    for field in ("bias", "cos", "sin", "mats", "mix"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def test_normalize_mode_is_dinov3s_box_and_tables_read_it_in_reference_patches():
    c = vitpe.grid_coords((4, 6), (8, 8), "normalize")
    torch.testing.assert_close(c[:6, 0], (torch.arange(0.5, 6) / 6) * 2 - 1)
    torch.testing.assert_close(c[::6, 1], (torch.arange(0.5, 4) / 4) * 2 - 1)
    # learned and rel_bias read normalize-mode coordinates as interpolate-mode ones: the same box spans the table
    for name in ("learned", "rel_bias", "cpb", "fire"):
        pe = vitpe.build_pos_embed(name, dim=32, num_heads=2, ref_grid=(8, 8))
        for size in [(8, 8), (12, 16), (5, 7)]:
            a = pe.context(vitpe.PatchGrid.create(size, (8, 8), "normalize"))
            b = pe.context(vitpe.PatchGrid.create(size, (8, 8), "interpolate"))
            for field in ("tokens", "bias"):
                if getattr(a, field) is not None:
                    torch.testing.assert_close(getattr(a, field), getattr(b, field), atol=1e-5, rtol=1e-5)


def test_rope_axial_takes_dinov3s_periods():
    hd, lo, hi = 32, 0.5, 50.0
    freqs = period_rope_freqs(hd, lo, hi)
    # DINOv3: periods = max * (max/min)^(linspace(0, 1) - 1); angle = 2 pi x / period, x first on its axis
    periods = hi * (hi / lo) ** (torch.linspace(0, 1, hd // 4, dtype=torch.float64) - 1)
    torch.testing.assert_close(freqs[0, : hd // 4].double(), 2 * math.pi / periods, rtol=1e-6, atol=0)
    assert freqs[0, hd // 4 :].eq(0).all() and freqs[1, : hd // 4].eq(0).all()
    pe = vitpe.build_pos_embed("rope_axial", dim=64, num_heads=2, ref_grid=8, min_period=lo, max_period=hi, coord_mode="normalize")
    assert torch.equal(pe.freqs, freqs)
    with pytest.raises(ValueError, match="both min_period and max_period"):
        vitpe.build_pos_embed("rope_axial", dim=64, num_heads=2, ref_grid=8, min_period=lo)


# ---- extrapolation controls --------------------------------------------------------------------------------------

def angles_at(name, size, mode="extrapolate", **opts):
    pe = vitpe.build_pos_embed(name, dim=64, num_heads=2, ref_grid=(8, 8), **opts)
    grid = vitpe.PatchGrid.create(size, (8, 8), mode)
    return pe, pe.rope_angles(grid)


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn"])
@pytest.mark.parametrize("name", ["rope_axial", "rope_golden", "string", "rope_mixed"])
def test_controls_are_exactly_the_identity_within_the_trained_extent(name, method):
    torch.manual_seed(0)
    plain = vitpe.build_pos_embed(name, dim=64, num_heads=2, ref_grid=(8, 8), depth=2)
    scaled = vitpe.build_pos_embed(name, dim=64, num_heads=2, ref_grid=(8, 8), depth=2, scaling=method)
    scaled.load_state_dict(plain.state_dict())
    for size, mode in [((8, 8), "extrapolate"), ((16, 16), "interpolate"), ((16, 24), "normalize"), ((6, 8), "extend")]:
        grid = vitpe.PatchGrid.create(size, (8, 8), mode)
        assert torch.equal(plain.rope_angles(grid), scaled.rope_angles(grid)) and scaled.rope_magnitude(grid) is None


@pytest.mark.parametrize("method", ["ntk", "yarn"])
def test_extend_mode_scales_only_the_axes_longer_than_trained(method):
    # 6 x 16 against 8 x 8: x spans twice the trained extent, extrapolated, and takes the control; y is shorter and
    # interpolated, so it keeps its trained frequencies. Axial RoPE gives each pair one axis: compare pair by pair.
    pe, extend = angles_at("rope_axial", (6, 16), "extend", scaling=method)
    _, extrapolated = angles_at("rope_axial", (6, 16), "extrapolate", scaling=method)
    _, interpolated = angles_at("rope_axial", (6, 16), "interpolate")
    x = pe.freqs[0] != 0
    torch.testing.assert_close(extend[:, x], extrapolated[:, x])
    torch.testing.assert_close(extend[:, ~x], interpolated[:, ~x])
    assert not torch.allclose(extend[:, x], angles_at("rope_axial", (6, 16), "extend")[1][:, x])  # the control acted


def test_pi_equals_interpolate_mode_up_to_a_constant_phase():
    _, extr = angles_at("rope_axial", (16, 24), scaling="pi")
    _, interp = angles_at("rope_axial", (16, 24), mode="interpolate")
    # angles differ by a per-frequency constant, so every q.k (a function of angle differences) is the same
    diff = extr - interp
    torch.testing.assert_close(diff, diff[:1].expand_as(diff), atol=1e-5, rtol=0)


def test_ntk_is_base_scaling_on_axial_rope():
    s, hd = 2.0, 32
    _, ntk = angles_at("rope_axial", (16, 16), scaling="ntk")
    d = hd // 2  # rotary dimensions per axis
    _, base = angles_at("rope_axial", (16, 16), theta=100.0 * s ** (d / (d - 2)))
    torch.testing.assert_close(ntk, base, atol=1e-5, rtol=1e-5)


def test_yarn_keeps_fast_bands_interpolates_slow_ones_and_sets_the_temperature():
    pe, yarn = angles_at("rope_axial", (16, 32), scaling="yarn", yarn_alpha=0.1, yarn_beta=1.0)
    _, plain = angles_at("rope_axial", (16, 32))
    coords = vitpe.grid_coords((16, 32), (8, 8), "extrapolate")
    f = pe.freqs[0, :8]  # x frequencies
    turns = 8 * f / (2 * math.pi)
    fast, slow = turns > 1.0, turns < 0.1
    assert fast.any() and slow.any()
    x = coords[:, :1]
    torch.testing.assert_close(yarn[:, :8][:, fast], plain[:, :8][:, fast])
    torch.testing.assert_close(yarn[:, :8][:, slow], (x * f / 4)[:, slow], atol=1e-5, rtol=1e-5)  # x axis: ratio 32/8 = 4
    grid = vitpe.PatchGrid.create((16, 32), (8, 8), "extrapolate")
    torch.testing.assert_close(pe.rope_magnitude(grid), torch.full((512,), 0.1 * math.log(math.sqrt(2 * 4)) + 1))
    ctx = pe.context(grid)  # the temperature scales q and k: |rotated| = m |q|
    q = torch.randn(1, 2, 512, 32)
    torch.testing.assert_close(ctx.rotate(q, q, 0)[0].norm(dim=-1), q.norm(dim=-1) * (0.1 * math.log(math.sqrt(8)) + 1))


def test_p_rope_leaves_the_lowest_frequencies_unrotated():
    for name in ("rope_axial", "rope_golden", "rope_mixed", "string"):
        pe, angles = angles_at(name, (8, 8), p_rope=0.25)
        a = angles.reshape(-1, angles.shape[-2], angles.shape[-1])  # (heads..., N, P)
        still = (a == 0).all(-2)  # pairs that never turn
        assert still.sum(-1).eq(4).all(), name  # a quarter of 16 pairs, per head
        mag = pe.frequencies().detach().norm(dim=0).reshape(-1, 16)
        for h in range(mag.shape[0]):
            assert mag[h][still[h]].max() <= mag[h][~still[h]].min()


def test_matrix_rotary_takes_pi_and_refuses_what_needs_a_frequency_table():
    for name in ("liere", "comrope"):
        pe = build(name)
        with pytest.raises(ValueError, match="no frequency table"):
            pe.scaling = "yarn"
        with pytest.raises(ValueError, match="unknown option 'p_rope'"):
            vitpe.build_pos_embed(name, dim=64, num_heads=2, ref_grid=8, p_rope=0.5)
        pe.scaling = "pi"
        big = pe.context(vitpe.PatchGrid.create((16, 16), (8, 8), "extrapolate"), dtype=torch.float64).mats
        # PI compresses the coordinates into the trained extent: a 16x16 grid from an 8x8 reference at half spacing
        half = vitpe.grid_coords((16, 16)).double() / 2
        torch.testing.assert_close(big, PF.blocks_to_dense(PF.generator_rotations(half, pe.generators())), atol=1e-9, rtol=0)


def small_vit(pos_embed, num_heads=2, **kw):
    """A 32 px, 2-block model in eval mode: enough for the test-time controls to change what it computes."""
    return vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=num_heads, num_classes=3,
                                   pos_embed=pos_embed, **kw).eval()


def test_set_rope_extrapolation_on_a_trained_model_drops_cached_rotations():
    model = small_vit("sincos2d+rope_axial", coord_mode="extrapolate")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
        assert set_rope_extrapolation(model, "yarn") == ["rope_axial"]
        after = model(x)
        assert not torch.allclose(before, after)
        set_rope_extrapolation(model, "none")
        torch.testing.assert_close(model(x), before)
    with pytest.raises(ValueError, match="no rotary positional encoding"):
        set_rope_extrapolation(small_vit("learned"), "yarn")
    with pytest.raises(ValueError, match="unknown rope scaling 'yarm'"):
        set_rope_extrapolation(model, "yarm")


def test_lookhere_slope_k_at_k_times_the_grid_in_interpolate_mode_is_extrapolate_mode():
    model, x = small_vit("lookhere", num_heads=4, coord_mode="extrapolate"), torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        extrapolated = model(x)
        model.coord_mode = "interpolate"
        interpolated = model(x)
        assert not torch.allclose(interpolated, extrapolated)  # distances in reference patches: half the penalties
        assert set_lookhere_slope(model, 2.0) == ["lookhere"]
        torch.testing.assert_close(model(x), extrapolated)
        set_lookhere_slope(model, 1.0)
        torch.testing.assert_close(model(x), interpolated)
        combined = small_vit("learned+lookhere", num_heads=4)
        before = combined(x)
        assert set_lookhere_slope(combined, 3.0) == ["lookhere"]
        assert not torch.allclose(combined(x), before)  # the combination's cached biases were dropped
    with pytest.raises(ValueError, match=r"no positional encoding of this model \(sincos2d\) takes the test-time option 'lookhere.slope'"):
        set_lookhere_slope(small_vit("sincos2d"), 2.0)
    for bad in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="must be positive and finite"):
            set_lookhere_slope(model, bad)


def test_alibi2d_is_a_line_in_the_euclidean_distance_with_alibis_slopes():
    from vitpe.pos_embed.bias import alibi_slopes

    # ALiBi's slopes: 2^(-8k/n) for a power of two; else the nearest power below, then every other one of the next up.
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes(3).tolist() == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    pe = vitpe.build_pos_embed("alibi2d", dim=32, num_heads=4, ref_grid=(4, 5))
    for mode, size in (("interpolate", (8, 10)), ("extrapolate", (6, 7)), ("interpolate", (4, 5))):
        grid = vitpe.PatchGrid.create(size, (4, 5), mode)
        c = grid.coords
        expected = -alibi_slopes(4)[:, None, None] * (c[:, None] - c[None]).norm(dim=-1)
        torch.testing.assert_close(pe.bias(grid), expected)
    grid = vitpe.PatchGrid.create((4, 5))
    before = pe.bias(grid)
    assert vitpe.set_pe_option(pe, "alibi2d.slope_scale", "2") == ["alibi2d"]
    torch.testing.assert_close(pe.bias(grid), 2 * before)  # a test-time option: the cached bias is not reused


def test_pape_adds_a_parabola_in_each_projected_offset_that_the_query_shapes():
    """The features PaPE appends to q and k make q.k grow by sum_k -a_k d_k^2 + b_k d_k (scaled as q.k), d_k the
    projected offset, a_k = softplus and b_k linear in the query's token (the paper's eq.; its code's layout)."""
    torch.manual_seed(0)
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                                    pos_embed="pape", pos_embed_kwargs={"parabolas": 3}).eval()
    pe, x = model.pos_embed, torch.randn(2, 3, 24, 16)
    with torch.no_grad():
        tokens, pos = model.embed(x)
        xn = model.blocks[1].norm1(tokens)
        logits = model.blocks[1].attn.attention_logits(xn, pos, 1)
        q, k, _ = model.blocks[1].attn._split(xn, pos)
        p = pe.position[1](vitpe.PatchGrid.create((6, 4), (4, 4)).coords).view(24, 2, 3).transpose(0, 1)  # (H, N, P)
        ab = pe.coefficients[1](xn[:, 1:]).view(2, 24, 2, 2, 3).permute(2, 0, 3, 1, 4)
        d = p[:, :, None] - p[:, None]  # (H, N, N, P): query minus key
        extra = (-F.softplus(ab[0])[:, :, :, None] * d ** 2 + ab[1][:, :, :, None] * d).sum(-1)
        expected = q @ k.transpose(-2, -1) / 4.0
        expected[:, :, 1:, 1:] += extra / 4.0  # the class token carries no position
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        fast = model.blocks[1].attn(xn, pos, 1)
        _, _, v = model.blocks[1].attn._split(xn, pos)
        torch.testing.assert_close(fast, model.blocks[1].attn.proj(torch.einsum("bhqk,bhkd->bqhd", logits.softmax(-1), v).flatten(2)),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one parabola"):
        vitpe.build_pos_embed("pape", dim=32, num_heads=2, ref_grid=4, parabolas=0)
