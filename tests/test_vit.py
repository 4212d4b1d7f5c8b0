"""The ViT: attention reproduces the worked examples, the fast path equals the explicit one, bad input is refused clearly."""
import math
from unittest import mock

import pytest
import torch
from torch import nn

import vitpe

X = torch.tensor([[1.0, 0, 1, 0], [0, 2, 0, 2]])


def _attention(wq, wk, wv, heads):
    """An Attention whose projections are the given (d_model x d_k) matrices, per head, and no output projection."""
    d_k = wq[0].shape[1]
    attn = vitpe.Attention(dim=4, num_heads=heads, head_dim=d_k, qkv_bias=False)
    w = torch.cat([torch.cat(ws, dim=1) for ws in (wq, wk, wv)], dim=1)  # (4, 3 * heads * d_k): q | k | v, heads inside
    with torch.no_grad():
        attn.qkv.weight.copy_(w.t())
    attn.proj = nn.Identity()
    return attn


def test_single_head_attention_reproduces_the_worked_example():
    wq = torch.tensor([[1.0, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]])
    wk = torch.tensor([[0.0, 1, 0], [1, 1, 0], [1, 0, 1], [0, 1, 1]])
    wv = torch.tensor([[0.0, 2, 0], [1, 0, 3], [1, 1, 0], [0, 0, 1]])
    attn = _attention([wq], [wk], [wv], heads=1).eval()
    logits = attn.attention_logits(X[None])[0, 0]
    torch.testing.assert_close(logits * math.sqrt(3), torch.tensor([[4.0, 10], [6, 16]]))
    out = attn(X[None])[0]
    torch.testing.assert_close(out, torch.tensor([[1.97, 0.09, 7.76], [2.00, 0.01, 7.98]]), atol=0.01, rtol=0)


def test_two_head_attention_reproduces_the_worked_example():
    wq = [torch.tensor([[1.0, 0], [1, 1], [0, 1], [1, 0]]), torch.tensor([[0.0, 1], [1, 0], [1, 1], [0, 0]])]
    wk = [torch.tensor([[0.0, 1], [1, 1], [1, 0], [0, 1]]), torch.tensor([[1.0, 1], [0, 1], [0, 0], [1, 0]])]
    wv = [torch.tensor([[0.0, 2], [1, 0], [1, 1], [0, 0]]), torch.tensor([[1.0, 1], [0, 3], [1, 0], [2, 1]])]
    attn = _attention(wq, wk, wv, heads=2).eval()
    logits = attn.attention_logits(X[None])[0] * math.sqrt(2)
    torch.testing.assert_close(logits, torch.tensor([[[2.0, 6], [6, 16]], [[3.0, 6], [2, 4]]]))
    concat = attn(X[None])[0]
    # The notes round the softmax weights to two digits before multiplying, hence the tolerance.
    torch.testing.assert_close(concat, torch.tensor([[1.95, 0.15, 3.78, 7.23], [1.999, 0.003, 3.62, 6.67]]), atol=0.05, rtol=0)
    w_o = torch.tensor([[1.0, 0, 1, 0], [0, 2, 0, 1], [1, 0, 0, 1], [0, 1, 1, 0]])
    torch.testing.assert_close(concat @ w_o, torch.tensor([[5.73, 7.53, 9.18, 3.93], [5.62, 6.676, 8.619, 3.626]]), atol=0.1, rtol=0)


@pytest.mark.parametrize("pe", ["none", "rel_bias", "rope_mixed", "sincos2d+rope_axial", "cpb"])
def test_sdpa_path_equals_explicit_softmax(pe):
    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed=pe, num_reg_tokens=2).eval()
    x, pos = model.embed(torch.randn(2, 3, 16, 16))
    attn = model.blocks[1].attn
    with torch.no_grad():
        _, _, v = attn._split(x)
        explicit = attn.proj(torch.einsum("bhqk,bhkd->bqhd", attn.attention_logits(x, pos, 1).softmax(-1), v).flatten(2))
        torch.testing.assert_close(attn(x, pos, 1), explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pe", ["rel_bias", "cpb", "fire", "lookhere"])
def test_a_shared_bias_reaches_sdpa_as_a_4d_mask(pe):
    """torch's CPU SDPA takes its slow math path for a 3-D float mask and its fused kernel for the same mask in 4-D
    (5.5x at 1,024 tokens): a shared grid's (heads, T, T) bias must arrive as (1, heads, T, T)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        seen.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    model = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, pos_embed=pe).eval()
    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
        model(torch.randn(3, 3, 24, 16))
    assert seen[0] == (1, 2, 25, 25) and seen[1] == (1, 2, 1, 25)  # the last block keeps only the class token's query


def test_shapes_pooling_and_prefix_tokens():
    for kw in [dict(pool="cls"), dict(pool="mean", class_token=False), dict(pool="mean", num_reg_tokens=4)]:
        m = vitpe.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=7, **kw)
        feats = m.forward_features(torch.randn(2, 3, 32, 48))
        assert feats.shape == (2, m.num_prefix_tokens + 8 * 12, 32)
        assert m(torch.randn(2, 3, 32, 48)).shape == (2, 7)


def test_bf16_autocast_on_cpu_with_a_bias_encoding():
    m = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="rel_bias+rope_mixed")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(torch.randn(2, 3, 64, 64))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_bad_input_raises_clear_value_errors():
    m = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    with pytest.raises(ValueError, match=r"input size 30x32 is not a multiple of patch_size 8; resize or crop it, e\.g\. to 32x32"):
        m(torch.randn(1, 3, 30, 32))
    with pytest.raises(ValueError, match="expected 3 input channels, got 1"):
        m(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, H, W\)"):
        m(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        vitpe.VisionTransformer(img_size=30, patch_size=8)
    with pytest.raises(ValueError, match="pool='cls' needs class_token=True"):
        vitpe.VisionTransformer(img_size=32, patch_size=8, class_token=False)
    with pytest.raises(ValueError, match="is not a coordinate mode"):
        vitpe.VisionTransformer(img_size=32, patch_size=8, coord_mode="stretch")
    with pytest.raises(ValueError, match="valid options"):
        vitpe.VisionTransformer(img_size=32, patch_size=8, pos_embed="rope_axial", pos_embed_kwargs={"base": 10})
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=36, num_heads=6, pos_embed="rope_axial")


def test_no_weight_decay_names_exist():
    m = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, pos_embed="learned+cpb")
    names = dict(m.named_parameters())
    assert {n for n in m.no_weight_decay() if n in names} == m.no_weight_decay()
    assert "pos_embed.parts.0.table" in m.no_weight_decay()


def test_state_dict_round_trip_reproduces_random_fourier_features():
    a = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="fourier").eval()
    b = vitpe.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3, pos_embed="fourier").eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))


@pytest.mark.parametrize("pe", ["learned", "rel_bias", "rope_mixed", "peg", "sincos2d+cpb"])
def test_class_token_fast_path_equals_the_full_forward(pe):
    """forward() computes the last block for the class token only; logits and every gradient must match the
    full forward_features path (peg conditions the last layer too, so the skipped tokens really are unused)."""
    kwargs = {"layers": [0, 1]} if pe == "peg" else {}
    torch.manual_seed(0)
    m = vitpe.VisionTransformer(img_size=16, patch_size=4, embed_dim=24, depth=2, num_heads=2, num_classes=5, pos_embed=pe,
                                pos_embed_kwargs=kwargs, num_reg_tokens=1)
    x = torch.randn(3, 3, 16, 24)
    fast = m(x)
    fast.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    full = m.forward_head(m.forward_features(x))
    full.square().sum().backward()
    torch.testing.assert_close(fast, full)
    for n, p in m.named_parameters():  # unused parameters: no gradient on the fast path, zeros on the full one
        if p.grad is not None:
            torch.testing.assert_close(grads.get(n, torch.zeros_like(p)), p.grad, msg=n)
    assert "blocks.1.mlp.fc1.weight" in grads


def test_the_config_names_every_model_argument():
    """ModelConfig is VisionTransformer's signature: a new model argument must be configurable (or set by the data)."""
    import dataclasses
    import inspect

    from vitpe.config import ModelConfig

    params = set(inspect.signature(vitpe.VisionTransformer.__init__).parameters) - {"self"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert params - fields == {"num_classes", "in_chans"} and fields <= params
    vitpe.VisionTransformer(**vars(ModelConfig()), num_classes=3)  # and the defaults build a model
