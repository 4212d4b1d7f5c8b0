"""vitpe and timm: equip a timm ViT with any vitpe PE, and load timm ViT weights into vitpe's ViT."""
from __future__ import annotations

import types
from typing import Any, Dict, Optional, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn

from .coords import COORD_MODES, PatchGrid, Size2, to_2tuple
from .pos_embed import PosContext, build_pos_embed
from .vit import VisionTransformer, attend, compute_dtype

__all__ = ["equip_timm_vit", "vit_from_timm", "load_timm_state_dict", "timm_to_vitpe_state_dict"]


def _split_prefix_positions(pos: Tensor, n_cls: int, n_reg: int, no_embed_class: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """timm's ``pos_embed`` ``(1, prefix + N, D)`` -> (cls position, register positions, patch positions).

    timm adds the prefix slots to the cls/register tokens; vitpe gives prefix tokens no position, so those
    slots are folded into the tokens themselves (``None`` where timm has none to fold).
    """
    if no_embed_class or not n_cls + n_reg:
        return None, None, pos
    prefix = pos[:, : n_cls + n_reg]
    return (prefix[:, :n_cls] if n_cls else None), (prefix[:, n_cls:] if n_reg else None), pos[:, n_cls + n_reg :]


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


def _attend(attn: nn.Module, x: Tensor, pos: PosContext, layer: int) -> Tensor:
    """timm's Attention forward with the PE's rotation and bias applied (same weights, same maths)."""
    q, k, v = rearrange(attn.qkv(x), "b t (s h d) -> s b h t d", s=3, h=attn.num_heads).unbind(0)
    out = attend(attn.q_norm(q), attn.k_norm(k), v, pos, layer, attn.attn_drop.p if attn.training else 0.0)
    return attn.proj_drop(attn.proj(attn.norm(out)))


def _vitpe_forward_features(self, x: Tensor, attn_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
    """Replacement for timm's ``VisionTransformer.forward_features`` once equipped with a vitpe PE."""
    if attn_mask is not None or is_causal:
        raise ValueError("a timm ViT equipped with a vitpe PE takes no attn_mask/is_causal")
    h, w = x.shape[-2:]
    ph, pw = self.patch_embed.patch_size
    if h % ph or w % pw:
        raise ValueError(f"input size {h}x{w} is not a multiple of the patch size {ph}x{pw}; resize or crop it")
    x = self.patch_embed(x)
    x = x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() == 4 else x  # NHWC (dynamic_img_size) or NLC
    grid = PatchGrid.create((h // ph, w // pw), self.vitpe_ref_grid, self.vitpe_coord_mode, device=x.device)
    pos = self.vitpe_pos_embed.context(grid, self.num_prefix_tokens, compute_dtype(x))
    x = pos.add_tokens(x)
    prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
    x = torch.cat(prefix + [x], dim=1) if prefix else x
    x = self.norm_pre(self.patch_drop(self.pos_drop(x)))
    for i, blk in enumerate(self.blocks):
        x = x + blk.drop_path1(blk.ls1(_attend(blk.attn, blk.norm1(x), pos, i)))
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
        x = pos.after_block(i, x)
    return self.norm(x)


def equip_timm_vit(
    model: nn.Module,
    pos_embed: str = "rope_mixed",
    pos_embed_kwargs: Optional[Dict[str, Any]] = None,
    coord_mode: str = "interpolate",
    ref_grid: Optional[Size2] = None,
) -> nn.Module:
    """Give a timm ``VisionTransformer`` a vitpe positional encoding, in place; returns the model.

    The timm model's own absolute table is removed (with ``pos_embed="learned"`` its patch part seeds
    vitpe's table, and a class-token position is folded into the class token, so the function is
    unchanged). Its ``forward``/``forward_features`` then compute the grid from the input, so the model
    runs at any size divisible by the patch size, as a vitpe model does. ``ref_grid`` defaults to the
    model's ``patch_embed.grid_size``. The PE lives at ``model.vitpe_pos_embed`` (saved in its state dict).
    """
    _check_timm_vit(model)
    if coord_mode not in COORD_MODES:
        raise ValueError(f"unknown coord_mode {coord_mode!r}; expected one of {COORD_MODES}")
    ref = to_2tuple(ref_grid or tuple(model.patch_embed.grid_size), "ref_grid")
    dim = model.embed_dim
    pe = build_pos_embed(pos_embed, dim=dim, num_heads=model.blocks[0].attn.num_heads, ref_grid=ref, depth=len(model.blocks),
                         **(pos_embed_kwargs or {}))
    old = model.pos_embed
    if old is not None:
        with torch.no_grad():
            n_reg = 0 if model.reg_token is None else model.reg_token.shape[1]
            cls_pos, reg_pos, old = _split_prefix_positions(old, int(model.cls_token is not None), n_reg, model.no_embed_class)
            if cls_pos is not None:
                model.cls_token.add_(cls_pos)
            if reg_pos is not None:
                model.reg_token.add_(reg_pos)
            table = getattr(pe, "table", None)
            if pos_embed == "learned" and table is not None and old.shape[1] == ref[0] * ref[1]:
                table.copy_(rearrange(old, "1 (h w) d -> 1 d h w", h=ref[0]))
    model.pos_embed = None
    model.patch_embed.strict_img_size = False
    model.vitpe_pos_embed = pe.to(next(model.parameters()).device)
    model.vitpe_ref_grid = ref
    model.vitpe_coord_mode = coord_mode
    model.forward_features = types.MethodType(_vitpe_forward_features, model)
    return model


# ---- timm weights -> vitpe.VisionTransformer ---------------------------------------------------------
def timm_to_vitpe_state_dict(sd: Dict[str, Tensor], grid: Size2, num_prefix_tokens: int, no_embed_class: bool = False) -> Dict[str, Tensor]:
    """Rename a timm ViT state dict for ``vitpe.VisionTransformer(pos_embed="learned")``.

    ``pos_embed`` ``(1, prefix + h*w, D)`` becomes the learned table ``(1, D, h, w)``; positions of
    the prefix tokens are added to the tokens themselves (vitpe gives prefix tokens no position).
    """
    h, w = to_2tuple(grid, "grid")
    out: Dict[str, Tensor] = {}
    for k, v in sd.items():
        if k == "patch_embed.proj.weight":
            out["patch_embed.weight"] = v
        elif k == "patch_embed.proj.bias":
            out["patch_embed.bias"] = v
        elif k == "pos_embed":
            continue
        else:
            out[k] = v
    if "pos_embed" in sd:
        n_cls = int("cls_token" in out)
        cls_pos, reg_pos, pos = _split_prefix_positions(sd["pos_embed"], n_cls, num_prefix_tokens - n_cls, no_embed_class)
        if cls_pos is not None:
            out["cls_token"] = out["cls_token"] + cls_pos
        if reg_pos is not None:
            out["reg_token"] = out["reg_token"] + reg_pos
        if pos.shape[1] != h * w:
            raise ValueError(f"timm pos_embed has {pos.shape[1]} patch positions, expected {h}x{w}={h * w}")
        out["pos_embed.table"] = rearrange(pos, "1 (h w) d -> 1 d h w", h=h)
    return out


def vit_from_timm(timm_model: nn.Module, **overrides: Any) -> VisionTransformer:
    """A ``vitpe.VisionTransformer`` with the same architecture and weights as a timm ViT (learned APE;
    ``pos_embed=...`` among ``overrides`` swaps in another PE with fresh parameters).

    Supports the classic ViT/DeiT layout: fused qkv, class-token pooling with a final norm (or mean
    pooling without ``fc_norm``), no LayerScale or qk-norm. Anything else raises ``ValueError``.
    """
    _check_timm_vit(timm_model)
    m = timm_model
    blk = m.blocks[0]
    unsupported = []
    if not isinstance(blk.ls1, nn.Identity):
        unsupported.append("LayerScale (init_values)")
    if not isinstance(blk.attn.q_norm, nn.Identity):
        unsupported.append("qk_norm")
    if not isinstance(m.fc_norm, nn.Identity):
        unsupported.append("fc_norm")
    if not isinstance(m.norm_pre, nn.Identity):
        unsupported.append("pre-norm (norm_pre)")
    if m.global_pool not in ("token", "avg"):
        unsupported.append(f"global_pool={m.global_pool!r}")
    if m.pos_embed is None:
        unsupported.append("a model without an absolute pos_embed")
    if unsupported:
        raise ValueError(f"this timm ViT uses {', '.join(unsupported)}, which vitpe.VisionTransformer does not have")
    patch = m.patch_embed.patch_size
    if patch[0] != patch[1]:
        raise ValueError(f"non-square patches {patch} are not supported")
    args = dict(
        img_size=tuple(m.patch_embed.img_size), patch_size=patch[0], in_chans=m.patch_embed.proj.in_channels,
        num_classes=m.num_classes, embed_dim=m.embed_dim, depth=len(m.blocks), num_heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.fc1.out_features / m.embed_dim, pos_embed="learned", class_token=m.cls_token is not None,
        num_reg_tokens=0 if m.reg_token is None else m.reg_token.shape[1], pool="cls" if m.global_pool == "token" else "mean",
        qkv_bias=blk.attn.qkv.bias is not None, norm_eps=blk.norm1.eps,
    )
    args.update(overrides)
    model = VisionTransformer(**args)
    load_timm_state_dict(model, m.state_dict(), no_embed_class=m.no_embed_class)
    return model.to(next(m.parameters()).device).eval()


def load_timm_state_dict(model: VisionTransformer, state_dict: Dict[str, Tensor], no_embed_class: bool = False) -> None:
    """Load timm ViT weights into a vitpe ``VisionTransformer``.

    With ``pos_embed="learned"`` timm's table becomes vitpe's; with any other PE the timm table is left
    out and the PE keeps its own (fresh) parameters: everything else must match exactly.
    """
    from .checkpoint import load_model_state

    sd = timm_to_vitpe_state_dict(state_dict, model.ref_grid, model.num_prefix_tokens, no_embed_class)
    own = model.state_dict()
    if "pos_embed.table" not in own:
        sd.pop("pos_embed.table", None)
    sd.update({k: v for k, v in own.items() if k.startswith("pos_embed.") and k not in sd})
    load_model_state(model, sd, "timm state dict")
