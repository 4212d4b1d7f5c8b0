"""Coordinates per image: packed mixed-size rows, token dropping and per-image coordinate augmentation, for every PE."""
import warnings

import pytest
import torch
from conftest import ALL_PE

import vitpe
from vitpe import TokenGrid, image_patches, pack_images, pack_patches

PES = ALL_PE + ["cpb+rope_axial"]
SIZES = [(16, 16), (24, 8), (8, 20)]  # three grids: 4x4, 6x2, 2x5 patches around an 4x4 reference


def small(pe, **kw):
    kw = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_classes": 5, "num_reg_tokens": 1,
          "drop_path_rate": 0.0, "pos_embed": pe, **kw}
    return vitpe.VisionTransformer(**kw)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pool", ["cls", "mean"])
@pytest.mark.parametrize("pe", PES)
def test_packed_row_equals_separate_forwards_logits_and_gradients(pe, pool):
    m = small(pe, pool=pool).double()  # float64: the comparison measures the method, not float32 summation order
    imgs = [torch.randn(3, h, w, dtype=torch.float64) for h, w in SIZES]
    w = torch.randn(len(imgs), 5, dtype=torch.float64)
    sep = torch.cat([m(i[None]) for i in imgs])
    (sep * w).sum().backward()
    g_sep = grads(m)
    m.zero_grad()
    packed = pack_images(imgs, 4, 40)  # 16 + 12 + 10 = 38 tokens: one row, two padding tokens
    assert packed.patches.shape[0] == 1 and packed.num_tokens == 38
    out = m(packed)
    torch.testing.assert_close(out, sep, atol=1e-5, rtol=1e-5)
    (out * w).sum().backward()
    g_pack = grads(m)
    assert g_pack.keys() == g_sep.keys()
    for n in g_sep:
        torch.testing.assert_close(g_pack[n], g_sep[n], atol=1e-5, rtol=1e-5, msg=lambda s, n=n: f"{pe} grad {n}: {s}")


@pytest.mark.parametrize("pe", PES)
def test_perturbing_one_packed_image_leaves_the_others_unchanged(pe):
    m = small(pe).eval()
    imgs = [torch.randn(3, h, w) for h, w in SIZES]
    base = m(pack_images(imgs, 4, 64))
    imgs[1] = imgs[1] + 3 * torch.randn_like(imgs[1])
    moved = m(pack_images(imgs, 4, 64))
    torch.testing.assert_close(moved[[0, 2]], base[[0, 2]], atol=1e-6, rtol=0)  # no leakage via attention, bias or PEG
    assert (moved[1] - base[1]).abs().max() > 1e-3


def test_packing_fills_rows_first_fit_and_keeps_input_order():
    imgs = [torch.randn(1, 8 * a, 4) for a in (3, 1, 2, 2)]  # 6, 2, 4, 4 tokens at patch 4
    p = pack_images(imgs, 4, 8)
    assert p.patches.shape == (2, 8, 16)
    assert p.grid.images.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] and p.grid.images_per_row == 2
    assert p.grid.segments.tolist() == [[0] * 6 + [1] * 2, [0] * 4 + [1] * 4]
    torch.testing.assert_close(p.patches[0, :6], image_patches(imgs[0], 4))
    # Largest first: 2, 2, 6, 6 tokens fill two rows of 8 (in input order, first fit would open a third).
    imgs = [torch.randn(1, 8 * a, 4) for a in (1, 1, 3, 3)]
    p = pack_images(imgs, 4, 8)
    assert p.patches.shape[0] == 2 and p.grid.images.tolist() == [[0, 1], [1, 1], [0, 0], [1, 0]]
    torch.testing.assert_close(p.patches[0, 6:], image_patches(imgs[0], 4))  # image 0 fills row 0 after image 2


@pytest.mark.parametrize("pe", PES)
def test_token_dropped_forward_equals_a_forward_given_exactly_those_tokens(pe):
    m = small(pe).eval()
    x = torch.randn(3, 3, 16, 16)
    kept = TokenGrid.from_grid(m.patch_grid((4, 4), x.device), 3).keep_random(0.5, torch.Generator().manual_seed(1))
    assert kept.coords.shape == (3, 8, 2) and len({tuple(c) for c in kept.cells.flatten(1).tolist()}) == 3  # per-image subsets
    dropped = m(x, grid=kept)
    for b in range(3):  # image b alone, given only its kept patches and their cells
        alone = pack_patches([(image_patches(x[b], 4)[kept.cells[b, :, 1] * 4 + kept.cells[b, :, 0]], kept.cells[b], (4, 4))], 8, 4)
        torch.testing.assert_close(dropped[b : b + 1], m(alone), atol=1e-5, rtol=1e-5)
    torch.manual_seed(3)
    a = m(x, token_keep=0.5)
    torch.manual_seed(3)
    again = m(x, grid=TokenGrid.from_grid(m.patch_grid((4, 4), x.device), 3).keep_random(0.5))
    torch.testing.assert_close(a, again, atol=0, rtol=0)


def test_peg_scatters_dropped_tokens_onto_a_zero_grid():
    pe = vitpe.build_pos_embed("peg", dim=8, num_heads=2, ref_grid=4)
    full = TokenGrid.from_grid(vitpe.PatchGrid.create((4, 4)), 2)
    kept = full.keep_random(0.5, torch.Generator().manual_seed(0))
    x = torch.randn(2, 8, 8)
    canvas = torch.zeros(2, 16, 8)
    index = kept.cells[..., 1] * 4 + kept.cells[..., 0]
    canvas.scatter_(1, index[..., None].expand(-1, -1, 8), x)
    expect = pe.condition(0, canvas, vitpe.PatchGrid.create((4, 4))).gather(1, index[..., None].expand(-1, -1, 8)) - canvas.gather(
        1, index[..., None].expand(-1, -1, 8)) + x
    torch.testing.assert_close(pe.condition(0, x, kept), expect, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="peg convolves over the token grid"):
        pe.condition(0, x, TokenGrid.from_coords(kept.coords, 4))


@pytest.mark.parametrize("pe", PES)
def test_per_image_augmentation_of_magnitude_zero_equals_the_shared_grid(pe):
    m = small(pe).eval()
    x = torch.randn(4, 3, 16, 16)
    shared = m.patch_grid((4, 4), x.device)
    per_image = TokenGrid.from_grid(shared, 4).augmented(torch.tensor([[1.0, 1.0, 0.0, 0.0]]).expand(4, -1))
    assert torch.equal(per_image.coords, shared.coords.expand(4, -1, -1))  # the identity gives the grid back bit for bit
    torch.testing.assert_close(m(x, grid=per_image), m(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pe", PES)
@pytest.mark.filterwarnings("ignore:coord_aug draws per image")  # liere's and comrope's cost: the test below
def test_per_image_augmentation_draws_per_image_for_every_family(pe):
    m = small(pe, coord_aug={"shift": 1.0, "rescale": 1.5, "jitter": 1.2}).train()
    x = torch.randn(4, 3, 16, 16)
    _, pos = m.embed(x)
    assert pos.grid.batched and pos.grid.coords.shape == (4, 16, 2)
    assert len({tuple(a) for a in pos.grid.affine[:, 0].tolist()}) == 4  # four images, four draws
    m(x).sum().backward()  # every family trains on per-image coordinates
    aug = vitpe.CoordAugment(shift=2.0, rescale=1.3)
    packed = pack_images([torch.randn(3, h, w) for h, w in SIZES], 4, 40)
    g = aug(packed.grid.rebased((4, 4), "interpolate"))
    per_token = g.affine[0, :38]
    assert len({tuple(a) for a in per_token.tolist()}) == 3  # one draw per packed image, shared by its tokens


def test_a_draw_per_image_warns_where_rotations_are_matrix_exponentials():
    # liere / comrope on per-image coordinates: exponentials per image (0.03 and 0.11 of their speed, measured).
    for pe, part in (("liere", "liere"), ("comrope", "comrope"), ("sincos2d+liere", "liere")):
        with pytest.warns(UserWarning, match=rf"so {part} takes (a )?matrix exponentials? per image.*per_image: false draws once per batch"):
            small(pe, coord_aug={"shift": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where a draw costs nothing more
        small("liere", coord_aug={"shift": 1.0, "per_image": False})
        small("comrope")
        small("rope_mixed", coord_aug={"shift": 1.0})


def test_shared_grid_keeps_one_shared_bias_per_image_grids_one_each():
    m = small("rel_bias").eval()
    x = torch.randn(2, 3, 16, 16)
    _, shared = m.embed(x)
    _, per_image = m.embed(x, grid=TokenGrid.from_grid(m.patch_grid((4, 4), x.device), 2))
    assert shared.bias.shape == (2, 18, 18) and per_image.bias.shape == (2, 2, 18, 18)  # 16 patches + class + register


def test_per_image_coordinate_and_packing_errors():
    m = small("sincos2d").eval()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"must have shape \(B, N, 2\)"):
        TokenGrid.from_coords(torch.randn(16, 2), 4)
    with pytest.raises(ValueError, match="give 9 tokens per image, the input has 4x4 patches"):
        m(x, grid=TokenGrid.from_coords(torch.randn(2, 9, 2), 4))
    with pytest.raises(ValueError, match="for 3 images, the batch has 2"):
        m(x, grid=TokenGrid.from_coords(torch.randn(3, 16, 2), 4))
    with pytest.raises(vitpe.PackingError, match="max_tokens must be a positive"):
        pack_images([torch.randn(3, 8, 8)], 4, 0)
    with pytest.raises(vitpe.PackingError, match=r"image 1 has 24 patch tokens .* more than the budget of max_tokens=16"):
        pack_images([torch.randn(3, 8, 8), torch.randn(3, 16, 24)], 4, 16)
    with pytest.raises(vitpe.PackingError, match="not a multiple of patch_size 4; resize it, e.g. to 12x8"):
        pack_images([torch.randn(3, 13, 8)], 4, 16)
    with pytest.raises(ValueError, match="token_keep must be in"):
        m(x, token_keep=0.0)
    with pytest.raises(ValueError, match=r"token_keep must be in \(0, 1\], got 1.5"):
        pack_images([torch.randn(3, 8, 8)], 4, 16, token_keep=1.5)
    with pytest.raises(ValueError, match="output_fmt='NLC'"):
        m.forward_intermediates(pack_images([torch.randn(3, 8, 8)], 4, 16))


@pytest.mark.parametrize("pe", ["learned+rope_mixed+rel_bias+peg"])  # a token, a rotary, a bias and a conditional part
def test_every_per_image_path_traces_without_graph_breaks(pe, monkeypatch):
    """torch.compile sees through the PE context: no cache keyed on data_ptr/_version, no data-dependent reads."""
    import torch._dynamo as dynamo

    import vitpe.pos_embed.bias as bias_module

    lattice, taken = bias_module._row_lattices, []
    monkeypatch.setattr(bias_module, "_row_lattices", lambda grid: taken.append(lattice(grid)) or taken[-1])
    m = small(pe, coord_aug={"shift": 1.0}).train()
    x = torch.randn(4, 3, 16, 16)
    packed = pack_images([torch.randn(3, h, w) for h, w in SIZES], 4, 40)
    for run in (lambda: m(x), lambda: m(x, token_keep=0.5), lambda: m(packed)):
        taken.clear()
        explained = dynamo.explain(lambda: run().sum())()
        assert explained.graph_break_count == 0, explained.break_reasons
        assert taken and all(t is not None for t in taken)  # per-image augmented (and packed) grids: the lattice path, traced
    m.eval()
    compiled = torch.compile(m, backend="aot_eager")  # traced, without needing a C++ compiler
    torch.testing.assert_close(compiled(packed), m(packed), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled(x), m(x), atol=1e-5, rtol=1e-5)
    dynamo.reset()


def test_batch_level_augmentation_combines_with_token_dropping_and_part_modes():
    m = small("learned+rope_mixed", coord_aug={"shift": 1.0, "rescale": 1.5, "per_image": False},
              pos_embed_kwargs={"rope_mixed.coord_mode": "extrapolate"}).train()
    m(torch.randn(2, 3, 16, 16), token_keep=0.5).sum().backward()  # one draw for the batch, then a subset per image
    shared = vitpe.PatchGrid.create((4, 6), (4, 4), "interpolate").transformed(1.3, 0.9, 0.5, -0.25)
    per_image = TokenGrid.from_grid(shared, 3)
    torch.testing.assert_close(per_image.coords[1], shared.coords)
    # Each part may read the grid in its own mode; the per-image grid redoes the same augmentation in that mode.
    torch.testing.assert_close(per_image.in_mode("extrapolate").coords[2], shared.in_mode("extrapolate").coords, atol=1e-5, rtol=1e-5)


def test_content_tokens_keeps_the_patches_that_differ_from_the_background():
    from vitpe.coords import content_tokens

    x = torch.zeros(2, 1, 16, 16)
    x[0, :, 4:8, 8:12] = 1.0  # image 0: patch (row 1, col 2) = token 6, and a faint one, token 9
    x[0, :, 9, 5] = 0.2
    x[1, :, 12:16, 0:8] = -3.0  # image 1: tokens 12 and 13 (darker than the background counts as well)
    assert content_tokens(x, 4, 2 / 16).tolist() == [[6, 9], [12, 13]]
    # A bright background is background too: the border's median decides, not zero.
    assert content_tokens(1.0 - x, 4, 2 / 16).tolist() == [[6, 9], [12, 13]]
    assert content_tokens(x, 4, 1.0).tolist() == [list(range(16))] * 2 and content_tokens(x, 4, 0.01).shape == (2, 1)
    with pytest.raises(ValueError, match=r"content_keep must be in \(0, 1\]"):
        content_tokens(x, 4, 0.0)


@pytest.mark.parametrize("pe", ["rope_axial+peg", "learned+rel_bias"])
def test_content_keep_is_a_forward_given_those_tokens_in_training_and_evaluation(pe):
    from vitpe.coords import content_tokens

    torch.manual_seed(0)
    kw = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5, pos_embed=pe, pool="mean")
    kept_model = vitpe.VisionTransformer(content_keep=0.5, **kw)
    full_model = vitpe.VisionTransformer(**kw)
    full_model.load_state_dict(kept_model.state_dict())
    x = torch.randn(3, 3, 16, 16)
    x[:, :, :, :8] = 0.0  # a background half: the kept half is the content
    for train in (False, True):
        kept_model.train(train), full_model.train(train)
        torch.manual_seed(1)
        got = kept_model(x)
        grid = TokenGrid.from_grid(full_model.patch_grid((4, 4), x.device), 3).take(content_tokens(x, 4, 0.5))
        assert (grid.cells[..., 0] >= 2).all()  # columns 2 and 3: the right, non-background half
        torch.manual_seed(1)
        torch.testing.assert_close(got, full_model(x, grid=grid), atol=1e-6, rtol=1e-6)
    assert kept_model.eval()(torch.randn(2, 3, 24, 32)).shape == (2, 5)  # another size: half of its 48 patches
    with pytest.raises(ValueError, match="do not form one"):
        kept_model.forward_intermediates(x, output_fmt="NCHW")
    with pytest.raises(ValueError, match="a packed batch brings its own tokens"):
        kept_model(pack_images([torch.randn(3, 16, 16)], 4, 16))
    with pytest.raises(ValueError, match=r"content_keep=.* is out of range; it must be in \(0, 1\]"):
        vitpe.VisionTransformer(content_keep=1.5, **kw)


@pytest.mark.parametrize("mode", ["interpolate", "extrapolate", "normalize", "extend"])
@pytest.mark.parametrize("pe", ["fire", "cpb", "rel_bias", "lookhere"])
def test_per_image_lattices_give_the_every_pair_bias(pe, mode, monkeypatch):
    # Augmented (and token-dropped) images are each still a lattice: the bias families evaluate their function at each
    # image's (2h-1)(2w-1) distinct offsets and gather. It must equal evaluating it at every pair.
    import vitpe.pos_embed.bias as bias_module

    enc = vitpe.build_pos_embed(pe, dim=32, num_heads=4, ref_grid=(4, 4), depth=2)
    shared = vitpe.PatchGrid.create((6, 5), (4, 4), mode)
    torch.manual_seed(0)
    grids = {"augmented": vitpe.CoordAugment(shift=1.0, rescale=2.0, jitter=1.25)(shared, 3)}
    grids["augmented, dropped"] = grids["augmented"].keep_random(0.5)
    # NaViT: images of several sizes and aspect ratios in one row, each its own lattice (own step in interpolate and
    # normalize mode, own augmentation, own extent for FIRE), some tokens dropped, two padding tokens.
    packed = pack_images([torch.randn(3, 4 * h, 4 * w) for h, w in [(6, 5), (3, 4), (2, 6), (5, 5)]], 4, 48,
                         token_keep=0.75, ref_grid=(4, 4), coord_mode=mode).grid
    grids["packed, augmented, dropped"] = vitpe.CoordAugment(shift=1.0, rescale=2.0, jitter=1.25)(packed)
    for name, grid in grids.items():
        assert bias_module._row_lattices(grid) is not None, name  # the fast path is taken
        fast = enc.bias(grid)
        with monkeypatch.context() as patched:
            patched.setattr(bias_module, "_row_lattices", lambda grid: None)
            every_pair = enc.bias(grid)
        assert fast.shape == every_pair.shape and fast.shape[-2:] == grid.coords.shape[1:2] * 2
        if grid.segments is not None:  # pairs across packed images are masked out in attention: only their own count
            same = (grid.segments[:, :, None] == grid.segments[:, None, :]) & (grid.segments[:, :, None] >= 0)
            assert grid.segments.amax() > 0 and (~same).any()
            fast, every_pair = fast.movedim(-3, -1)[..., same, :], every_pair.movedim(-3, -1)[..., same, :]
        torch.testing.assert_close(fast, every_pair, atol=1e-5, rtol=1e-5, msg=f"{pe} {mode} {name}")
    # Two rows, one with a single image where the other has two: its empty slot must not poison the gradients.
    grid = vitpe.CoordAugment(shift=1.0, rescale=2.0)(pack_images([torch.randn(3, 24, 20), torch.randn(3, 8, 8), torch.randn(3, 20, 20)],
                                                                 4, 32, ref_grid=(4, 4), coord_mode=mode).grid)
    assert grid.images_per_row == 2 and sorted(grid.segments.amax(1).tolist()) == [0, 1]
    out = enc.bias(grid)
    assert not out.isnan().any()  # (lookhere: -inf outside a head's field of view)
    if out.requires_grad:  # lookhere learns nothing
        out.sum().backward()
        assert all(p.grad.isfinite().all() for p in enc.parameters() if p.grad is not None), f"{pe} {mode}"
    per_token = grids["augmented"].augmented(torch.rand(3, 30, 4) + 0.5)  # a different affine per token: no lattice
    assert bias_module._row_lattices(per_token) is None


@pytest.mark.parametrize("mode", ["interpolate", "normalize"])
@pytest.mark.parametrize("variant", ["ld", "ap"])
def test_comrope_on_per_image_lattices_takes_w_plus_h_exponentials_per_image(variant, mode, monkeypatch):
    # Commuting generators: exp(x A_x + y A_y) = exp(x A_x) exp(y A_y), and on a lattice per image x depends on the
    # column alone, y on the row: one exponential per image column and row must give every token's rotation.
    import vitpe.pos_embed.lie as lie

    enc = vitpe.build_pos_embed("comrope", dim=32, num_heads=2, ref_grid=(4, 4), depth=2, variant=variant)
    torch.manual_seed(0)
    augment = vitpe.CoordAugment(shift=1.0, rescale=2.0, jitter=1.25)
    grids = {"augmented": augment(vitpe.PatchGrid.create((6, 5), (4, 4), mode), 3)}
    grids["augmented, dropped"] = grids["augmented"].keep_random(0.5)
    # Two images to a row, each its own lattice (own step, own augmentation), some tokens dropped, padding.
    grids["packed, augmented, dropped"] = augment(pack_images([torch.randn(3, 4 * h, 4 * w) for h, w in [(6, 5), (6, 5), (5, 5), (6, 4)]],
                                                              4, 48, token_keep=0.75, ref_grid=(4, 4), coord_mode=mode).grid)
    exponentials = []
    matrix_exp = torch.linalg.matrix_exp
    monkeypatch.setattr(torch.linalg, "matrix_exp", lambda a: exponentials.append(a.shape[:-2].numel()) or matrix_exp(a))
    for name, grid in grids.items():
        per_token = lie.generator_rotations(grid.coords, enc.generators())  # one exponential per token
        exponentials.clear()
        fast = enc.rope_rotations(grid)
        assert lie._row_axes(grid, grid.coords) is not None, name  # the fast path is taken
        assert sum(exponentials) < per_token[..., 0, 0].numel(), name  # (B, L, H, S (w + h), K) against (B, L, H, N, K)
        keep = torch.ones(grid.coords.shape[:2], dtype=torch.bool)
        if grid.segments is not None:  # padding tokens' rotations are never read
            assert grid.images_per_row == 2 and (grid.segments < 0).any()
            keep = grid.segments >= 0
        torch.testing.assert_close(fast.movedim(-4, 1)[keep], per_token.movedim(-4, 1)[keep], atol=1e-5, rtol=1e-5, msg=name)
    liere = vitpe.build_pos_embed("liere", dim=32, num_heads=2, ref_grid=(4, 4), depth=2)
    assert lie._row_axes(grids["augmented"], grids["augmented"].coords) is not None
    torch.testing.assert_close(liere.rope_rotations(grids["augmented"]), lie.generator_rotations(grids["augmented"].coords, liere.generators()))
    off_lattice = grids["augmented"].augmented(torch.rand(3, 30, 4) + 0.5)  # a different affine per token: no lattice
    assert lie._row_axes(off_lattice, off_lattice.coords) is None
