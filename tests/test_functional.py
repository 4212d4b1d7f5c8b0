"""The maths of the encodings, checked against the formulas and the identities they promise."""
import math

import pytest
import torch

import vitpe
from vitpe.pos_embed import functional as PF
from vitpe.pos_embed.bias import log_spaced
from vitpe.pos_embed.rotary import axial_rope_freqs, mixed_rope_freqs


def test_grid_coords_formula_and_order():
    c = vitpe.grid_coords((2, 3), ref_grid=(4, 6), mode="interpolate")
    assert c.shape == (6, 2) and c.dtype == torch.float32
    xs = [(j + 0.5) * 6 / 3 - 0.5 for j in range(3)]
    ys = [(i + 0.5) * 4 / 2 - 0.5 for i in range(2)]
    expected = torch.tensor([[x, y] for y in ys for x in xs])  # row-major, columns (x, y)
    torch.testing.assert_close(c, expected)
    e = vitpe.grid_coords((2, 3), ref_grid=(4, 6), mode="extrapolate")
    torch.testing.assert_close(e, torch.tensor([[x, y] for y in range(2) for x in range(3)], dtype=torch.float32))


@pytest.mark.parametrize("mode", ["interpolate", "extrapolate"])
def test_grid_coords_reference_grid_is_integer_lattice(mode):
    a = vitpe.grid_coords((3, 5), ref_grid=(3, 5), mode=mode)
    b = vitpe.grid_coords((3, 5))
    integer = torch.tensor([[x, y] for y in range(3) for x in range(5)], dtype=torch.float32)
    assert torch.equal(a, integer) and torch.equal(b, integer)


def test_extend_mode_extrapolates_the_longer_axes_and_interpolates_the_shorter():
    # 6 rows x 12 columns against an 8 x 8 reference: x (12 > 8) continues the integer grid, y (6 < 8) keeps the
    # trained extent; a grid no larger than the reference is interpolate mode, one no smaller is extrapolate mode.
    ext, interp = (vitpe.grid_coords((6, 12), (8, 8), m) for m in ("extend", "interpolate"))
    torch.testing.assert_close(ext[:, 0], vitpe.grid_coords((6, 12), (8, 8), "extrapolate")[:, 0])
    torch.testing.assert_close(ext[:, 1], interp[:, 1])
    for size, same in [((5, 8), "interpolate"), ((4, 3), "interpolate"), ((8, 11), "extrapolate"), ((16, 9), "extrapolate")]:
        assert torch.equal(vitpe.grid_coords(size, (8, 8), "extend"), vitpe.grid_coords(size, (8, 8), same)), size
    grid = vitpe.PatchGrid.create((6, 12), (8, 8), "extend")
    assert grid.spacing == (1.0, pytest.approx(8 / 6)) and grid.extent().tolist() == [12.0, 8.0]
    # The per-token formula (packed rows of mixed sizes) agrees with the grid's, axis by axis.
    cells, sizes = vitpe.coords.grid_cells((6, 12)), torch.tensor([12, 6])
    torch.testing.assert_close(vitpe.cell_coords(cells[None], sizes.expand(1, 72, 2), (8, 8), "extend")[0], ext)


def test_grid_coords_interpolate_keeps_extent():
    fine = vitpe.grid_coords(32, ref_grid=16)
    # Same extent as the reference grid: patch edges at -0.5 and 15.5 reference patches.
    assert fine[:, 0].min().item() == pytest.approx(-0.25) and fine[:, 0].max().item() == pytest.approx(15.25)


def test_grid_coords_bad_input():
    with pytest.raises(ValueError, match="is not a coordinate mode; choose one of interpolate, extrapolate, normalize, extend"):
        vitpe.grid_coords(4, mode="stretch")
    with pytest.raises(ValueError, match="positive"):
        vitpe.grid_coords((0, 4))


def test_sincos_1d_is_the_transformer_formula():
    pos, dim = torch.arange(7).float(), 8
    pe = vitpe.sincos_1d(pos, dim)
    for p in range(7):
        for i in range(dim // 2):
            w = 1 / 10000 ** (2 * i / dim)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(p * w), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(p * w), abs=1e-6)


def _rotation(dim: int, k: float, base: float = 10000.0) -> torch.Tensor:
    """Block-diagonal M_k with PE(t + k) = M_k PE(t): pairs (sin wt, cos wt) turn by w k."""
    blocks = []
    for i in range(dim // 2):
        a = k / base ** (2 * i / dim)
        blocks.append(torch.tensor([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]], dtype=torch.float64))
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("k", [1, 3, 7.5])
def test_sincos_shift_is_a_rotation(k):
    dim, t = 16, torch.tensor([0.0, 2.0, 5.0, 11.0], dtype=torch.float64)
    pe_t, pe_tk = vitpe.sincos_1d(t, dim), vitpe.sincos_1d(t + k, dim)
    torch.testing.assert_close(pe_tk, pe_t @ _rotation(dim, k).T)


def test_sincos_dot_product_depends_only_on_offset():
    dim = 32
    pe = vitpe.sincos_1d(torch.arange(40, dtype=torch.float64), dim)
    gram = pe @ pe.T
    for d in (0, 1, 5, 13):
        diag = torch.diagonal(gram, offset=d)
        w = 1 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        torch.testing.assert_close(diag, torch.full_like(diag, torch.cos(w * d).sum().item()))


def test_sincos_2d_is_concat_of_x_then_y():
    coords = torch.tensor([[0.0, 0.0], [1.5, -2.0], [3.0, 7.25]])
    pe = vitpe.sincos_2d(coords, 16)
    torch.testing.assert_close(pe, torch.cat([vitpe.sincos_1d(coords[:, 0], 8), vitpe.sincos_1d(coords[:, 1], 8)], -1))
    with pytest.raises(ValueError, match="divisible by 4"):
        vitpe.sincos_2d(coords, 18)


def test_apply_rope_matches_complex_rotation_and_keeps_norms():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    angles = torch.randn(5, 4, dtype=torch.float64)
    out = vitpe.apply_rope(x, angles)
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("kind", ["axial", "mixed"])
def test_rope_dot_product_depends_only_on_coordinate_offset(kind):
    head_dim, heads = 16, 2
    freqs = axial_rope_freqs(head_dim) if kind == "axial" else mixed_rope_freqs(head_dim, heads)
    q, k = torch.randn(heads, 1, head_dim), torch.randn(heads, 1, head_dim)
    coords = torch.randn(6, 2) * 5
    shift = torch.tensor([[3.7, -2.2]])

    def scores(c):
        a = PF.rope_angles(c, freqs)  # (H|., N, hd/2)
        return vitpe.apply_rope(q, a) @ vitpe.apply_rope(k, a).transpose(-1, -2)  # (H, N, N)

    torch.testing.assert_close(scores(coords), scores(coords + shift), atol=1e-4, rtol=1e-4)
    # And explicitly: <R(a_m) q, R(a_n) k> = <q, R(a_n - a_m) k>.
    a = PF.rope_angles(coords, freqs)
    a = a.expand(heads, -1, -1) if a.dim() == 2 else a
    lhs = (vitpe.apply_rope(q, a[:, :1]) * vitpe.apply_rope(k, a[:, 1:2])).sum(-1)
    rhs = (q * vitpe.apply_rope(k, a[:, 1:2] - a[:, :1])).sum(-1)
    torch.testing.assert_close(lhs, rhs, atol=1e-5, rtol=1e-5)


def test_axial_rope_splits_pairs_between_x_and_y():
    f = axial_rope_freqs(16, theta=100.0)
    assert f.shape == (2, 8)
    assert torch.all(f[0, :4] > 0) and torch.all(f[0, 4:] == 0) and torch.all(f[1, :4] == 0) and torch.all(f[1, 4:] > 0)
    torch.testing.assert_close(f[0, :4], 100.0 ** (-torch.arange(0, 16, 4).float() / 16))


def test_relative_position_index_matches_hand_worked_examples():
    # 2x2 window, positions (y, x) = (0,0),(0,1),(1,0),(1,1); index = (dy + 1) * 3 + (dx + 1).
    expected = torch.tensor([[4, 3, 1, 0], [5, 4, 2, 1], [7, 6, 4, 3], [8, 7, 5, 4]])
    assert torch.equal(vitpe.relative_position_index(2), expected)
    # 1x3 window: index = dx + 2 into a 1x5 table.
    assert torch.equal(vitpe.relative_position_index((1, 3)), torch.tensor([[2, 1, 0], [3, 2, 1], [4, 3, 2]]))


def test_relative_position_index_matches_swin_construction():
    h, w = 3, 4
    coords = torch.stack(torch.meshgrid([torch.arange(h), torch.arange(w)], indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += h - 1
    rel[:, :, 1] += w - 1
    rel[:, :, 0] *= 2 * w - 1
    assert torch.equal(vitpe.relative_position_index((h, w)), rel.sum(-1))


def test_lattice_offsets_gathered_by_index_equal_pairwise_offsets():
    for size, mode in [((3, 4), "interpolate"), ((5, 2), "extrapolate")]:
        g = vitpe.PatchGrid.create(size, (2, 3), mode)
        gathered = PF.lattice_offsets(size, g.spacing).flatten(0, 1)[vitpe.relative_position_index(size)]
        torch.testing.assert_close(gathered, PF.relative_offsets(g.coords))


def test_sample_bias_table_is_exact_at_integer_offsets():
    table = torch.randn(5 * 7, 3)
    idx = vitpe.relative_position_index((3, 4))
    offsets = PF.relative_offsets(vitpe.grid_coords((3, 4)))
    torch.testing.assert_close(PF.sample_bias_table(table, offsets, (3, 4)), table[idx], atol=1e-5, rtol=1e-5)


def test_log_spaced_matches_swin_v2_table():
    h, w = 4, 6
    rh = torch.arange(-(h - 1), h, dtype=torch.float32)
    rw = torch.arange(-(w - 1), w, dtype=torch.float32)
    table = torch.stack(torch.meshgrid([rh, rw], indexing="ij")).permute(1, 2, 0)  # (dh, dw) as in Swin-V2
    table[..., 0] /= h - 1
    table[..., 1] /= w - 1
    table = table * 8
    table = torch.sign(table) * torch.log2(table.abs() + 1.0) / math.log2(8)
    ours = log_spaced(PF.lattice_offsets((h, w), (1.0, 1.0)), (h, w))  # (dx, dy)
    torch.testing.assert_close(ours, table.flip(-1))


def test_complex_rotation_equals_the_real_form_with_gradients():
    """PosContext rotates float32 q/k as a complex product; it must equal rotate_pairs, gradients included,
    on the strided q/k views that the fused qkv projection produces."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3 * 2 * 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)  # (H, T, hd/2)
    outs = []
    for fast in (True, False):
        q = qkv.view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)[1]  # k: a non-contiguous (B, H, T, hd) view
        cos, sin = angles.cos(), angles.sin()
        out = vitpe.rotate_complex(q, torch.complex(cos, sin)) if fast else vitpe.rotate_pairs(q, cos, sin)
        grads = torch.autograd.grad(out.sin().sum(), (qkv, angles))
        outs.append((out, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_rope_context_uses_the_complex_rotation_only_in_full_precision():
    pe = vitpe.build_pos_embed("rope_mixed", dim=16, num_heads=2, ref_grid=(3, 3), depth=2)
    grid = vitpe.PatchGrid.create((3, 3), (3, 3))
    assert pe.context(grid, 1, torch.float32).rot.dtype == torch.complex64
    assert pe.context(grid, 1, torch.bfloat16).rot is None
    q = torch.randn(2, 2, 10, 8, dtype=torch.bfloat16)
    ctx = pe.context(grid, 1, torch.bfloat16)
    rq, _ = ctx.rotate(q, q, 1)
    ref = vitpe.rotate_pairs(q.float(), ctx.cos[1].float(), ctx.sin[1].float())
    torch.testing.assert_close(rq.float(), ref, atol=0.05, rtol=0.02)
