"""vitpe.viz: the drawn numbers are right, and the command writes the pictures."""
import json
import math
from pathlib import Path

import pytest
import torch

import vitpe
from vitpe import viz
from vitpe.cli import train as train_cmd
from vitpe.cli import viz as viz_cli
from vitpe.coords import content_tokens

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _shifted_equal(a, b, shift, size):
    """a is a map around query q, b around q + shift: compare where both are defined."""
    dr, dc = shift
    h, w = size
    return torch.testing.assert_close(a[0:h - dr, 0:w - dc], b[dr:h, dc:w], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, kind", [("sincos2d", "tokens"), ("rope_axial", "rotary"), ("rope_mixed", "rotary"), ("rel_bias", "bias"), ("cpb", "bias"),
                                        ("fire", "bias"), ("lookhere", "bias"), ("rope_golden", "rotary"), ("string", "rotary"),
                                        ("comrope", "rotary")])
def test_similarity_of_relative_structure_depends_only_on_the_offset(name, kind):
    pe = vitpe.build_pos_embed(name, dim=64, num_heads=4, ref_grid=8)
    a = viz.pe_similarity(pe, 8, (2, 3))[kind]
    b = viz.pe_similarity(pe, 8, (4, 5))[kind]
    for head in range(a.shape[0]):
        _shifted_equal(a[head], b[head], (2, 2), (8, 8))


@pytest.mark.parametrize("name", [n for n in vitpe.list_pos_embeds() if n not in ("none", "peg")])
def test_every_family_is_drawn(name, tmp_path):
    pe = vitpe.build_pos_embed(name, dim=64, num_heads=4, ref_grid=8, depth=2)
    mats, sims = viz.pe_matrix(pe, (6, 8)), viz.pe_similarity(pe, (6, 8), (2, 3))
    assert mats.keys() == sims.keys() and mats
    for kind, m in sims.items():
        assert m.shape[-2:] == (6, 8) and (torch.isfinite(m) | (m == float("-inf"))).all()
    if "rotary" in sims:  # a vector rotated at the query aligns fully with itself there
        torch.testing.assert_close(sims["rotary"][:, 2, 3], torch.ones(sims["rotary"].shape[0]), atol=1e-5, rtol=0)


def test_similarity_values():
    pe = vitpe.build_pos_embed("sincos2d", dim=64, num_heads=4, ref_grid=8)
    s = viz.pe_similarity(pe, 8, (3, 3))["tokens"][0]
    # The query is most similar to itself (cosine 1 up to rounding, which differs between torch builds) and
    # every other position is clearly less similar: the nearest neighbours sit near 0.93 on this grid.
    assert s[3, 3].item() == pytest.approx(1.0, abs=1e-5) and s.argmax().item() == 3 * 8 + 3
    assert (s < s[3, 3] - 1e-3).sum() == 63
    rb = vitpe.build_pos_embed("rel_bias", dim=64, num_heads=4, ref_grid=4)
    m = viz.pe_similarity(rb, 4, (0, 0))["bias"]
    table = rb.table.t().reshape(4, 7, 7)  # row = dy + 3: the query at (0, 0) sees keys at dy = -row
    torch.testing.assert_close(m[:, 1, 2], table[:, -1 + 3, -2 + 3].detach())
    with pytest.raises(ValueError, match="outside the 4x4 grid"):
        viz.pe_similarity(rb, 4, (4, 0))


def test_matrix_shapes_and_conditional_pe_refused():
    pe = vitpe.build_pos_embed("sincos2d+rel_bias+rope_axial", dim=64, num_heads=4, ref_grid=8)
    m = viz.pe_matrix(pe, (8, 6))
    assert m["tokens"].shape == (48, 64) and m["bias"].shape == (4, 48, 48) and m["rotary"].shape == (48, 16)
    torch.testing.assert_close(m["tokens"], vitpe.sincos_2d(vitpe.grid_coords((8, 6), 8), 64))
    with pytest.raises(ValueError, match="no position table"):
        viz.pe_matrix(vitpe.build_pos_embed("peg", dim=64, num_heads=4, ref_grid=8), 8)


def test_attention_distance_of_uniform_attention_is_the_mean_pairwise_distance():
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed="none")
    with torch.no_grad():
        for b in m.blocks:
            b.attn.qkv.weight.zero_()
            b.attn.qkv.bias.zero_()
    d = viz.attention_distance(m, torch.randn(3, 3, 16, 16))
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    pts = torch.stack([xs.flatten(), ys.flatten()], -1).float() * 4
    expected = torch.cdist(pts, pts).mean()
    assert d.shape == (2, 2)
    torch.testing.assert_close(d, torch.full((2, 2), expected.item()))


def uniform_attention(m):
    with torch.no_grad():
        for b in m.blocks:
            b.attn.qkv.weight.zero_()
            b.attn.qkv.bias.zero_()
    return m


def test_attention_entropy_of_uniform_attention_is_log_keys_and_distance_uses_each_images_kept_patches():
    m = uniform_attention(vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                                                  pos_embed="none", content_keep=0.5))
    images = torch.zeros(3, 3, 16, 16)
    images[0, :, :8, :8] = 1  # content in one corner: its 4 patches and 4 of the background are kept
    images[1, :, 8:, :] = 1  # the lower half: exactly its 8 patches
    images[2] = torch.randn(3, 16, 16)
    stats = viz.attention_stats(m, images, chunk=2)  # chunks of 2 and 1 images: weighted like one batch
    keys = 8 + 1  # 50% of 16 patches, and the class token
    torch.testing.assert_close(stats["entropy"], torch.full((2, 2), math.log(keys)))
    torch.testing.assert_close(stats["entropy_norm"], torch.ones(2, 2))
    kept = content_tokens(images, 4, 0.5)  # (3, 8) token indices per image, row-major on the 4x4 grid
    pts = torch.stack([kept % 4, kept // 4], -1).float() * 4
    expected = torch.cdist(pts, pts).mean()  # uniform over each image's own kept patches
    torch.testing.assert_close(stats["distance"], torch.full((2, 2), expected.item()))
    assert sorted((kept[1] // 4).tolist()) == [2, 2, 2, 2, 3, 3, 3, 3]  # the lower half is kept: the images differ
    assert not torch.isclose(torch.cdist(pts[1], pts[1]).mean(), torch.cdist(pts[0], pts[0]).mean())
    with pytest.raises(ValueError, match=r"takes an image batch \(B, C, H, W\)"):
        viz.attention_stats(m, images[0])


def test_attention_stats_of_a_trained_pattern_at_two_sizes_and_the_patch_route():
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed="rope_axial")
    x = torch.randn(4, 3, 32, 32)
    one = viz.attention_stats(m, x)
    assert all(v.shape == (2, 2) and torch.isfinite(v).all() for v in one.values())
    assert ((one["entropy_norm"] > 0) & (one["entropy_norm"] <= 1 + 1e-5)).all()
    torch.testing.assert_close(viz.attention_stats(m, x, chunk=3)["entropy"], one["entropy"])
    # FlexiViT's route: the 32 px images cut into 8 px patches make the trained 4x4 grid, distances in input pixels.
    patch = viz.attention_stats(m, x, patch_size=8)
    assert torch.isfinite(patch["distance"]).all() and (patch["distance"] <= 24 * 2**0.5).all()


def test_viz_command_writes_pictures_and_numbers(tmp_path):
    out = tmp_path / "v"
    assert viz_cli.main(["matrix", "--pe", "sincos2d", "--grid", "8", "--dim", "32", "--out", str(out)]) == 0
    assert viz_cli.main(["similarity", "--pe", "rope_mixed", "--grid", "8", "6", "--ref-grid", "4", "--query", "1", "2", "--out", str(out)]) == 0
    assert train_cmd.main(["--config", TINY, "--out-dir", str(tmp_path), "--name", "r", "--epochs", "1", "--pe", "rel_bias"]) == 0
    assert viz_cli.main(["similarity", "--checkpoint", str(tmp_path / "r"), "--grid", "4", "--out", str(out)]) == 0
    assert viz_cli.main(["attention-distance", str(tmp_path / "r"), "--resolutions", "16", "32", "--images", "16", "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["attention_distance.png", "matrix_sincos2d_8x8.png", "similarity_rel_bias_4x4.png", "similarity_rope_mixed_8x6.png"]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000
    dist = json.loads((out / "attention_distance.json").read_text())
    assert set(dist) == {"rel_bias @ 16px", "rel_bias @ 32px"} and len(dist["rel_bias @ 32px"]) == 2
    sim = json.loads((out / "similarity_rope_mixed_8x6.json").read_text())
    assert sim["query"] == [1, 2] and len(sim["rotary"][0]) == 8
