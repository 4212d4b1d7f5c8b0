"""vitpe inside timm: equip a timm ViT with any vitpe PE, and give Swin-V2's position MLP to vitpe's ``cpb``
(timm's ViTs as vitpe models: :mod:`vitpe.timm.convert`).

Which timm weights a PE can take is the PE's own answer (:meth:`vitpe.PosEmbed.from_timm`), never a guess
from key names.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..coords import CoordMode, PatchGrid, Size2, to_2tuple
from ..pos_embed import PosContext, PosEmbed, build_pos_embed
from ..vit import attend, compute_dtype, pin_traced_size, position_tokens

__all__ = ["equip_timm_vit", "cpb_from_swinv2", "fold_prefix_positions", "unwrap"]


def fold_prefix_positions(pos: Tensor, tokens: Sequence[Optional[Tensor]], no_embed_class: bool = False) -> Tuple[List[Optional[Tensor]], Tensor]:
    """timm's ``pos_embed`` ``(1, prefix + N, D)`` and its prefix tokens in timm's order (class, distillation, registers;
    ``None`` where the model has none) -> (each token with its position slot added, the patch positions ``(1, N, D)``).

    timm adds the prefix slots to the prefix tokens; vitpe gives prefix tokens no position, so those slots are folded
    into the tokens themselves. ``no_embed_class`` (DeiT-III, big_vision): the table holds patches only.
    """
    if no_embed_class:
        return list(tokens), pos
    folded, start = [], 0
    for t in tokens:
        folded.append(None if t is None else t + pos[:, start : start + t.shape[1]])
        start += 0 if t is None else t.shape[1]
    return folded, pos[:, start:]


def unwrap(model: nn.Module) -> nn.Module:
    """A ``features_only=True`` model wraps the ViT (timm's FeatureGetterNet keeps it at ``.model``)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    inner = getattr(model, "model", None)
    return inner if not isinstance(model, TimmViT) and isinstance(inner, TimmViT) else model


def _check_timm_vit(model: nn.Module) -> None:
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    if not isinstance(model, TimmViT):
        raise ValueError(f"expected a timm VisionTransformer (timm.create_model('vit_...')), got {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if not (hasattr(attn, "qkv") and hasattr(attn, "num_heads") and hasattr(attn, "proj")):
            raise ValueError(f"block {i} of this timm model has no fused-qkv attention ({type(attn).__name__}); vitpe PEs need one")
        if getattr(attn, "gate", None) is not None:
            raise ValueError("gated attention is not supported by vitpe's PE injection")


# ---- a timm ViT with a vitpe PE ------------------------------------------------------------------------
class _EquippedState:
    """The PE context of the input now going through an equipped model, shared by its blocks. A plain attribute
    of the model and of each block (not a closure), so ``copy.deepcopy`` (timm's EMA) copies it consistently."""

    __slots__ = ("pos", "tokens")

    def __init__(self) -> None:
        self.pos: Optional[PosContext] = None
        self.tokens = -1

    def __reduce__(self):  # the input now in flight is not part of the model: a copy or a saved model starts without it
        return (_EquippedState, ())


def _equipped_pos_embed(self, x: Tensor) -> Tensor:
    """Replaces timm's ``_pos_embed``, which every forward path calls (``forward_features``,
    ``forward_intermediates``, ``get_intermediate_layers``, features_only): ``(B, H, W, D)`` patch tokens ->
    ``(B, T, D)`` with the PE's tokens and prefix tokens, and the context the blocks read."""
    x = pin_traced_size(x, (1, 2), self.vitpe_pos_embed)
    b, h, w, d = x.shape
    grid = PatchGrid.create((h, w), self.vitpe_ref_grid, self.vitpe_coord_mode, device=x.device)
    pos = self.vitpe_pos_embed.context(grid, self.num_prefix_tokens, compute_dtype(x))
    x = position_tokens(x.reshape(b, h * w, d), pos, (self.cls_token, self.reg_token))
    self._vitpe_state.pos, self._vitpe_state.tokens = pos, x.shape[1]
    return self.pos_drop(x)


def _equipped_attention(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False, **unused: Any) -> Tensor:
    """timm's Attention forward with the PE's rotation and bias applied (same weights, same maths)."""
    if attn_mask is not None or is_causal:
        raise ValueError("a timm ViT equipped with a vitpe PE takes no attn_mask/is_causal (the PE gives the attention bias)")
    state = self._vitpe_state
    if state.pos is None or x.shape[1] != state.tokens:
        raise RuntimeError(
            "this block belongs to a timm ViT equipped with a vitpe PE: run it through the model "
            "(forward, forward_features, forward_intermediates), which computes the PE for the input"
        )
    q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, hd)
    out = attend(self.q_norm(q), self.k_norm(k), v, state.pos, self._vitpe_layer, self.attn_drop.p if self.training else 0.0, x=x)
    return self.proj_drop(self.proj(self.norm(out)))


def _equipped_block(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """A block after which a conditional PE (PEG) acts."""
    x = type(self).forward(self, x, *args, **kwargs)
    return self._vitpe_state.pos.after_block(self._vitpe_layer, x)


def _load_pe_from_timm(pe: PosEmbed, weights: Dict[str, Tensor]) -> None:
    """Give ``pe`` the timm weights it can take."""
    given = pe.from_timm(weights)
    if given:
        pe.load_state_dict({**pe.state_dict(), **given})


def equip_timm_vit(
    model: nn.Module,
    pos_embed: str = "rope_mixed",
    pos_embed_kwargs: Optional[Dict[str, Any]] = None,
    coord_mode: str = "interpolate",
    ref_grid: Optional[Size2] = None,
) -> nn.Module:
    """Give a timm ``VisionTransformer`` a vitpe positional encoding, in place; returns the model.

    The timm model's own absolute table is removed (a PE that can take it, e.g. ``"learned"``, is seeded with
    its patch part, and a class-token position is folded into the class token, so the function is unchanged).
    Every forward path then runs with the PE on the grid of the actual input: ``forward``,
    ``forward_features``, ``forward_intermediates``, ``get_intermediate_layers``, ``forward_head`` on their
    output, and a ``features_only=True`` model (pass it, or its ``.model``). ``ref_grid`` defaults to the
    model's ``patch_embed.grid_size``. The PE lives at ``model.vitpe_pos_embed`` (saved in its state dict).
    Attention masks and patch dropout are refused with a clear error.
    """
    from timm.layers import Format

    outer, model = model, unwrap(model)
    _check_timm_vit(model)
    coord_mode = CoordMode.parse(coord_mode)
    if not isinstance(getattr(model, "patch_drop", nn.Identity()), nn.Identity):
        raise ValueError("this timm ViT drops patches (patch_drop_rate > 0), which vitpe's PE injection does not support; build it with patch_drop_rate=0")
    if hasattr(model, "vitpe_pos_embed"):
        raise ValueError("this timm ViT is already equipped with a vitpe PE; create a fresh model to equip it with another")
    ref = to_2tuple(ref_grid or tuple(model.patch_embed.grid_size), "ref_grid")
    pe = build_pos_embed(pos_embed, dim=model.embed_dim, num_heads=model.blocks[0].attn.num_heads, ref_grid=ref,
                         depth=len(model.blocks), **(pos_embed_kwargs or {}))
    old = model.pos_embed
    if old is not None:
        with torch.no_grad():
            prefix = (model.cls_token, model.reg_token)
            folded, patches = fold_prefix_positions(old, prefix, model.no_embed_class)
            for token, value in zip(prefix, folded):
                if token is not None:
                    token.copy_(value)
            if patches.shape[1] == ref[0] * ref[1]:
                _load_pe_from_timm(pe, {"pos_embed": patches})
    model.pos_embed = None
    # The patch embedding hands over (B, H, W, D), so the grid of every input is known.
    model.patch_embed.strict_img_size = False
    model.patch_embed.flatten = False
    model.patch_embed.output_fmt = Format.NHWC
    model.dynamic_img_size = True
    model.vitpe_pos_embed = pe.to(next(model.parameters()).device)
    model.vitpe_ref_grid = ref
    model.vitpe_coord_mode = coord_mode
    model._vitpe_state = _EquippedState()
    model._pos_embed = functools.partial(_equipped_pos_embed, model)
    conditioned = pe.condition_layers()
    for i, blk in enumerate(model.blocks):
        blk.attn._vitpe_state, blk.attn._vitpe_layer = model._vitpe_state, i
        blk.attn.forward = functools.partial(_equipped_attention, blk.attn)
        if i in conditioned:
            blk._vitpe_state, blk._vitpe_layer = model._vitpe_state, i
            blk.forward = functools.partial(_equipped_block, blk)
    return outer


def cpb_from_swinv2(window_attention: nn.Module) -> PosEmbed:
    """vitpe's ``"cpb"`` with the weights of a Swin-V2 window attention (timm's ``WindowAttention`` in
    ``swin_transformer_v2``): the same bias ``(heads, N, N)`` on its window and, in extrapolate mode, on
    larger or smaller windows normalised by its pretraining window, as timm's ``set_window_size`` does.
    The MLP's input columns are swapped from Swin's ``(dy, dx)`` to vitpe's ``(dx, dy)``."""
    a = window_attention
    if not hasattr(a, "cpb_mlp"):
        raise ValueError(f"expected a Swin-V2 window attention with a cpb_mlp, got {type(a).__name__}")
    pretrained = tuple(a.pretrained_window_size)
    ref = pretrained if pretrained[0] > 0 else tuple(a.window_size)
    hidden, heads = a.cpb_mlp[0].out_features, a.cpb_mlp[-1].out_features
    pe = build_pos_embed("cpb", dim=heads, num_heads=heads, ref_grid=ref, hidden_dim=hidden, coord_mode="extrapolate")
    _load_pe_from_timm(pe, {k: v for k, v in a.state_dict().items() if k.startswith("cpb_mlp.")})
    return pe.to(a.cpb_mlp[0].weight.device)
