"""timm's ViTs as ``vitpe.VisionTransformer``: the same function, then vitpe's PE controls at any size.

:func:`vit_from_timm` reads what a timm model is (:func:`timm_architecture`: the model arguments, or one line naming what
vitpe lacks), which vitpe PE computes its position weights (:func:`timm_pos_embed`), and converts its weights
(:func:`convert_timm_state_dict`): separate q/k/v projections fused, SwiGLU's two input projections stacked, EVA's
LayerScale renamed, and q/k channels reordered so that timm's rotary pairs are vitpe's. vitpe rotates the pairs
``(2i, 2i+1)`` of each head, x pairs first; timm's rotary ports rotate ``(i, i + hd/2)`` (DINOv3) or interleaved pairs
with y first (EVA-02). A permutation applied alike to q and k leaves every ``q . k`` unchanged, so reordering the
projection's rows is exact.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn

from ..coords import Size2
from ..vit import VisionTransformer
from .interop import fold_prefix_positions, unwrap

__all__ = ["vit_from_timm", "timm_architecture", "timm_pos_embed", "convert_timm_state_dict", "load_timm_state_dict",
           "split_timm_state_dict", "timm_to_vitpe_state_dict"]

_PE_KEYS = ("pos_embed", "pos_embed_y", "pos_embed_x", "rope.freqs")  # timm's position weights, handed to the PE to take or leave


def _timm_layers(*names: str) -> Tuple[type, ...]:
    """timm layer classes by name; one this timm does not have yet (DINOv3's RoPE came after the oldest timm vitpe
    supports) is a class nothing is an instance of, so its models are refused by name instead of failing to import."""
    import timm.layers

    return tuple(getattr(timm.layers, n, type(n, (), {})) for n in names)


def _identity(mod: Optional[nn.Module]) -> bool:
    return mod is None or isinstance(mod, nn.Identity)


def _norm_kind(mod: nn.Module, where: str, problems: List[str]) -> Tuple[str, float]:
    """vitpe's name and eps for a timm norm layer."""
    TimmLayerNorm, RmsNorm = _timm_layers("LayerNorm", "RmsNorm")

    if isinstance(mod, (nn.LayerNorm, TimmLayerNorm)) and mod.elementwise_affine:
        return "layernorm", mod.eps
    if isinstance(mod, (RmsNorm, nn.RMSNorm)) and getattr(mod, "weight", None) is not None:
        return "rmsnorm", mod.eps
    problems.append(f"a {type(mod).__name__} {where}")
    return "layernorm", 1e-6


def _act_kind(mod: nn.Module, problems: List[str]) -> str:
    GELUTanh, QuickGELU = _timm_layers("GELUTanh", "QuickGELU")

    if isinstance(mod, nn.GELU):
        return "gelu_tanh" if mod.approximate == "tanh" else "gelu"
    if isinstance(mod, GELUTanh):
        return "gelu_tanh"
    if isinstance(mod, QuickGELU):
        return "quick_gelu"
    if isinstance(mod, nn.SiLU):
        return "silu"
    problems.append(f"a {type(mod).__name__} activation")
    return "gelu"


def _mlp_kind(mlp: nn.Module, problems: List[str]) -> Dict[str, Any]:
    """The MLP options: plain (fc1, act, fc2), GluMlp (fc1 gives gate and value), SwiGLU (fc1_g, fc1_x); a norm inside."""
    from timm.layers import GluMlp, Mlp, SwiGLU

    kind = type(mlp)
    if kind not in (Mlp, GluMlp, SwiGLU):
        problems.append(f"a {kind.__name__} MLP")
        return {}
    if kind is GluMlp and getattr(mlp, "chunk_dim", -1) != -1:
        problems.append("a GluMlp gated along another dimension")
    return dict(mlp_act=_act_kind(mlp.act, problems), mlp_gated=kind is not Mlp, mlp_norm=not _identity(mlp.norm),
                mlp_hidden_dim=mlp.fc2.in_features)


def _attention(attn: nn.Module, problems: List[str]) -> Dict[str, Any]:
    fused = getattr(attn, "qkv", None) is not None
    if not fused and not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
        problems.append(f"a {type(attn).__name__} attention")
        return {}
    if getattr(attn, "gate", None) is not None:
        problems.append("gated attention")
    if getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads:
        problems.append("grouped-query attention")
    head_dim = attn.head_dim if hasattr(attn, "head_dim") else attn.proj.in_features // attn.num_heads
    if abs(float(getattr(attn, "scale", head_dim**-0.5)) - head_dim**-0.5) > 1e-9:
        problems.append(f"an attention scale other than 1/sqrt({head_dim})")
    if not fused:
        bias = attn.q_proj.bias is not None or attn.v_proj.bias is not None
    else:
        bias = attn.qkv.bias is not None or getattr(attn, "q_bias", None) is not None
    return dict(qkv_bias=bias, qk_norm=not _identity(attn.q_norm), attn_norm=not _identity(getattr(attn, "norm", None)))


def _timm_naflex() -> type:
    """timm's NaFlexVit class (a class nothing is an instance of, in a timm without it)."""
    try:
        from timm.models.naflexvit import NaFlexVit
    except ImportError:
        return type("NaFlexVit", (), {})
    return NaFlexVit


def _patch_stem(m: nn.Module, problems: List[str]) -> Dict[str, Any]:
    """The stem of timm's ViT, Eva and relpos models: one patch convolution, prefix tokens on the model."""
    from timm.layers import PatchEmbed

    pe = m.patch_embed
    if type(pe) is not PatchEmbed or not isinstance(pe.proj, nn.Conv2d) or tuple(pe.proj.kernel_size) != tuple(pe.proj.stride):
        raise ValueError(f"this timm model uses a {type(pe).__name__} stem (vitpe's is one patch convolution), which "
                         "vitpe.VisionTransformer does not have")
    if pe.patch_size[0] != pe.patch_size[1]:
        problems.append(f"non-square patches {pe.patch_size}")
    if not _identity(getattr(pe, "norm", None)):
        problems.append("a norm in the patch embedding")
    reg = getattr(m, "reg_token", None)
    return dict(img_size=tuple(pe.img_size), patch_size=pe.patch_size[0], in_chans=pe.proj.in_channels, patch_bias=pe.proj.bias is not None,
                class_token=m.cls_token is not None, num_reg_tokens=0 if reg is None else reg.shape[1])


def _naflex_stem(m: nn.Module, problems: List[str]) -> Dict[str, Any]:
    """NaFlexVit's stem (``m.embeds``): a linear map of each flattened patch (a patch convolution, reshaped) or a
    convolution, its prefix tokens, and a position table on its own grid, which becomes vitpe's reference grid (its
    ``img_size`` is that grid's pixels; timm's default input size is another grid, which the table is resized to)."""
    e = m.embeds
    if e.is_linear and e.norm_input is not None:
        problems.append("a norm on the flattened patches")
    if not _identity(e.norm):
        problems.append("a norm in the patch embedding")
    if e.dynamic_img_pad:
        problems.append("padded images (dynamic_img_pad)")
    if getattr(m, "rope", None) is not None:
        problems.append("NaFlexVit's rotary embedding")
    if e.patch_size[0] != e.patch_size[1]:
        problems.append(f"non-square patches {e.patch_size}")
    patch = e.patch_size[0]
    if e.pos_embed_type == "none":
        img = tuple(m.pretrained_cfg.get("input_size", (3, 224, 224))[1:])
    else:
        img = tuple(g * patch for g in e.pos_embed_grid_size)
    reg = e.reg_token
    in_chans = e.proj.in_features // (patch * patch) if e.is_linear else e.proj.in_channels
    return dict(img_size=img, patch_size=patch, in_chans=in_chans, patch_bias=e.proj.bias is not None,
                class_token=e.cls_token is not None, num_reg_tokens=0 if reg is None else reg.shape[1])


def timm_architecture(m: nn.Module) -> Dict[str, Any]:
    """``vitpe.VisionTransformer`` arguments for timm's ``VisionTransformer`` (ViT, DeiT, DeiT-III, distilled DeiT, CLIP,
    SigLIP, registers, res-post-norm), ``Eva`` (EVA-02, DINOv3, RoPE-ViT, Perception Encoder), ``VisionTransformerRelPos``
    or ``NaFlexVit``, without the PE. Anything vitpe's ViT does not have is collected and raised as one ``ValueError`` naming all of it."""
    from timm.models.eva import Eva, EvaBlock
    from timm.models.vision_transformer import Block, ResPostBlock
    from timm.models.vision_transformer import VisionTransformer as TimmViT
    from timm.models.vision_transformer_relpos import RelPosBlock, ResPostRelPosBlock, VisionTransformerRelPos

    NaFlexVit = _timm_naflex()
    if not isinstance(m, (TimmViT, Eva, VisionTransformerRelPos, NaFlexVit)):
        raise ValueError(f"vit_from_timm takes timm's VisionTransformer, Eva, VisionTransformerRelPos and NaFlexVit models (vit_*, deit*, "
                         f"eva02*, *dinov3*, vit_relpos_*, naflexvit_*), not a {type(m).__name__}")
    problems: List[str] = []
    stem = _naflex_stem(m, problems) if isinstance(m, NaFlexVit) else _patch_stem(m, problems)
    blocks = list(m.blocks)
    kinds = {type(b) for b in blocks}
    pre, post = {Block, EvaBlock, RelPosBlock}, {ResPostBlock, ResPostRelPosBlock}
    if kinds - pre - post or len(kinds) > 1:
        raise ValueError(f"this timm model uses {', '.join(sorted(k.__name__ for k in kinds - pre))} blocks, which "
                         "vitpe.VisionTransformer does not have")
    blk = blocks[0]
    eva = isinstance(m, Eva)

    def block_kind(b: nn.Module, found: List[str]) -> Tuple[Any, ...]:
        layer_scale = getattr(b, "gamma_1", None) is not None if eva else not _identity(getattr(b, "ls1", None))
        return (_norm_kind(b.norm1, "block norm", found), _norm_kind(b.norm2, "block norm", found), layer_scale,
                _attention(b.attn, found), _mlp_kind(b.mlp, found))

    (norm_layer, eps), _, layer_scale, attn, mlp = first = block_kind(blk, problems)
    for i, b in enumerate(blocks[1:], 1):  # vitpe's blocks are all alike: one block changed (an activation swapped) is not
        found: List[str] = []
        if block_kind(b, found) != first or found:
            problems.append(f"block {i} unlike block 0 (its norms, attention or MLP differ)")
            break
    head = m.head
    if not (isinstance(head, nn.Linear) and head.bias is not None) and not (isinstance(head, nn.Identity) and m.num_classes == 0):
        what = f"a {type(head).__name__} head" if not isinstance(head, nn.Linear) else "a head without bias"
        problems.append(f"{what} (vitpe's head is one Linear with bias; reset_classifier gives timm's)")
    pool = m.global_pool
    attn_pool = getattr(m, "attn_pool", None)
    if attn_pool is not None:
        from timm.layers import AttentionPoolLatent

        if type(attn_pool) is not AttentionPoolLatent or attn_pool.latent_len != 1 or attn_pool.pool != "token" or attn_pool.pos_embed is not None \
                or not _identity(attn_pool.q_norm) or attn_pool.mlp is None or attn_pool.mlp.fc1.out_features != 4 * m.embed_dim \
                or _act_kind(attn_pool.mlp.act, problems) != mlp.get("mlp_act") or isinstance(attn_pool.q, nn.Identity):
            problems.append("an attention pool other than SigLIP's (one latent with its projection, no positions, a 4x MLP)")
        pool = "map"
    elif pool not in ("token", "avg"):
        problems.append(f"global_pool={pool!r}")
    norm, fc_norm, norm_pre = m.norm, getattr(m, "fc_norm", None), getattr(m, "norm_pre", None)
    if not _identity(norm) and not _identity(fc_norm):
        problems.append("both a final norm and fc_norm")
    for mod, where in ((norm, "final norm"), (fc_norm, "fc_norm"), (norm_pre, "pre-norm")):
        if not _identity(mod) and _norm_kind(mod, where, problems) != (norm_layer, eps):
            problems.append(f"a {where} unlike the blocks' norms")
    distilled = getattr(m, "dist_token", None) is not None
    if distilled and getattr(m, "distilled_training", False):
        problems.append("distilled training mode (set_distilled_training(False) first)")
    if problems:
        raise ValueError(f"this timm model uses {', '.join(problems)}, which vitpe.VisionTransformer does not have")
    # Eva's attention pool reads every token, timm's ViT's only the patches; NaFlexVit says which (pool_include_prefix)
    pool_prefix = bool(getattr(m, "pool_include_prefix", False)) and pool in ("avg", "map") or eva and pool == "map"
    return dict(
        **stem, num_classes=m.num_classes, embed_dim=m.embed_dim, depth=len(blocks), num_heads=blk.attn.num_heads,
        pool={"token": "cls", "avg": "mean"}.get(pool, pool), pool_prefix=pool_prefix,
        norm_eps=eps, norm_layer=norm_layer, init_values=1.0 if layer_scale else None,  # LayerScale's value is loaded
        pre_norm=not _identity(norm_pre),
        final_norm="tokens" if not _identity(norm) else "pooled" if not _identity(fc_norm) else "none", distilled=distilled,
        pool_heads=attn_pool.num_heads if attn_pool is not None else None, post_norm=bool(kinds & post),
        **attn, **mlp,
    )


# ---- position weights ---------------------------------------------------------------------------------------------
def _rope_layout(m: nn.Module, head_dim: int) -> Tuple[str, Dict[str, Any], str, Tensor]:
    """The vitpe rotary family, its options, the model's coordinate mode and the q/k channel order (``perm``: vitpe channel ``c`` reads timm's
    ``perm[c]`` within each head) that compute what timm's rotary embedding computes."""
    RotaryEmbeddingCat, RotaryEmbeddingDinoV3 = _timm_layers("RotaryEmbeddingCat", "RotaryEmbeddingDinoV3")

    rope = m.rope
    nb = head_dim // 4
    half = bool(getattr(rope, "rotate_half", False))  # an older timm (1.0.20) has interleaved pairs only, and no flag
    if isinstance(rope, RotaryEmbeddingDinoV3):
        # DINOv3: patch centres in [-1, 1] per axis (vitpe's normalize mode); y bands first, pairs (i, i + hd/2).
        if rope.normalize_coords != "separate" or rope.grid_offset or rope.grid_indexing != "ij" or rope.dim != head_dim:
            raise ValueError(f"this DINOv3 RoPE ({rope.normalize_coords!r} normalisation, offset {rope.grid_offset}) has no vitpe equal")
        if rope.min_period is not None:
            lo, hi = float(rope.min_period), float(rope.max_period)
        else:  # periods temperature^(k / nb), k = 0 .. nb-1
            lo, hi = 1.0, float(rope.temperature) ** ((nb - 1) / nb)
        return "rope_axial", {"min_period": lo, "max_period": hi}, "normalize", _pair_perm(head_dim, y_first=True, half=half)
    if isinstance(rope, RotaryEmbeddingCat):
        # EVA-02 / Perception Encoder: patch j at (j + grid_offset) * ref / n, n patches stretched onto ref_feat_shape; in
        # vitpe's interpolate coordinates u (frequencies scaled by ref/feat) that is u + 0.5 + (grid_offset - 0.5) * spacing.
        if rope.in_pixels or getattr(rope, "grid_type", "index") != "index" or getattr(rope, "linear_bands", False) or rope.dim != head_dim:
            raise ValueError("this timm RotaryEmbeddingCat (pixel bands) has no vitpe equal; vitpe takes EVA-02's index bands")
        if rope.ref_feat_shape is None:  # RoPE-ViT's axial port: patch j at j + grid_offset at every size (extrapolated)
            mode, scale, shift = "extrapolate", 1.0, {"offset": float(rope.grid_offset)}
        else:
            feat, ref = tuple(m.patch_embed.grid_size), tuple(rope.ref_feat_shape)
            stretch = {r / f for r, f in zip(ref, feat)}
            if len(stretch) != 1:
                raise ValueError(f"this timm RoPE stretches its {feat} grid onto {ref} unevenly; vitpe's rope_axial has one scale")
            mode, scale, shift = "interpolate", stretch.pop(), {"offset": 0.5, "cell_offset": float(rope.grid_offset) - 0.5}
        bands = rope.bands
        if bands is None:  # an older timm (1.0.20) keeps only the sin/cos table of a fixed-size model: its bands again
            from timm.layers.pos_embed_sincos import freq_bands

            bands = freq_bands(head_dim // 4, temperature=rope.temperature, step=1)
        bands = bands.double() * scale  # radians per patch of the model's grid
        opts = {"min_period": 2 * math.pi / float(bands[0]), "max_period": 2 * math.pi / float(bands[-1]), **shift}
        return "rope_axial", opts, mode, _pair_perm(head_dim, y_first=rope.grid_indexing == "ij", half=half)
    raise ValueError(f"this timm model's rotary embedding ({type(rope).__name__}) has no vitpe equal yet; vitpe loads RoPE-Mixed, "
                     "DINOv3's and EVA-02's")


def _relpos(m: nn.Module, relpos: nn.Module) -> Tuple[str, Dict[str, Any]]:
    """timm's relative-position ViTs: an MLP of ``sign(d) ln(1 + |d|)`` per block (or shared), its output the bias
    (``vit_relpos_*``, timm's "cr" form): vitpe's ``cpb`` with those options. timm runs them at one size only; vitpe evaluates
    the MLP at the new grid's offsets (interpolated: in the model's patches)."""
    from timm.layers.pos_embed_rel import RelPosMlp

    if not isinstance(relpos, RelPosMlp) or _relpos_mode(relpos) != "cr":
        raise ValueError(f"this timm model's relative position ({type(relpos).__name__}, mode {_relpos_mode(relpos)!r}) has no "
                         "vitpe equal; vitpe takes timm's 'cr' MLP (vit_relpos_*)")
    per_layer = getattr(m, "shared_rel_pos", None) is None
    opts = dict(hidden_dim=relpos.mlp.fc1.out_features, spacing="log", squash=False, out_bias=relpos.mlp.fc2.bias is not None, per_layer=per_layer)
    return "cpb", opts


def _naflex_pos_embed(e: nn.Module) -> Tuple[str, Dict[str, Any], Optional[str], Optional[Tensor]]:
    """NaFlexVit's tables, resized as timm resizes them for an image batch: the 2D table with its kernel, antialiasing,
    corners and aspect-preserving square; the factorized tables linearly (aspect-preserving too, where set)."""
    if e.pos_embed_type == "none":
        return "none", {}, None, None
    square = bool(e.pos_embed_ar_preserving)
    if e.pos_embed_type == "factorized":
        return "factorized", {"square": square}, "interpolate", None
    if e.pos_embed_interp_mode not in ("bicubic", "bilinear"):
        raise ValueError(f"this NaFlexVit resizes its table with {e.pos_embed_interp_mode!r}; vitpe's learned table takes bicubic and bilinear")
    # an older timm (1.0.20) names neither option: it always antialiased, never aligned corners
    opts = dict(mode=e.pos_embed_interp_mode, antialias=bool(getattr(e, "pos_embed_antialias", True)),
                align_corners=bool(getattr(e, "pos_embed_align_corners", False)), square=square)
    return "learned", opts, "interpolate", None


def _naflex_state_dict(m: nn.Module) -> Dict[str, Tensor]:
    """NaFlexVit's weights under timm's ViT names: the stem's tokens and tables out of ``embeds``, and its linear map of
    flattened patches (``(ph, pw, C)`` or ``(C, ph, pw)`` order) as the patch convolution it is."""
    e, out = m.embeds, {}
    for k, v in m.state_dict().items():
        if k.startswith("embeds."):
            k = k[len("embeds."):]
            k = "patch_embed." + k if k.startswith("proj.") else k
        out[k] = v
    if e.is_linear:
        p, w = e.patch_size, out["patch_embed.proj.weight"]
        layout = "d (ph pw c) -> d c ph pw" if getattr(e, "channels_last", True) else "d (c ph pw) -> d c ph pw"  # (ph, pw, C) before timm named it
        out["patch_embed.proj.weight"] = rearrange(w, layout, ph=p[0], pw=p[1])
    return out


def _relpos_mode(relpos: nn.Module) -> str:
    """A RelPosMlp's mode; an older timm (1.0.20) keeps none, so the coordinates it made say whether they are the "cr" form."""
    mode = getattr(relpos, "mode", None)
    if mode is None and hasattr(relpos, "rel_coords_log"):
        from timm.layers.pos_embed_rel import gen_relative_log_coords

        cr = gen_relative_log_coords(relpos.window_size, mode="cr").to(relpos.rel_coords_log)
        mode = "cr" if relpos.bias_gain is None and torch.equal(relpos.rel_coords_log, cr) else "swin or rw"
    return mode or "unknown"


def _pair_perm(head_dim: int, y_first: bool, half: bool) -> Tensor:
    """vitpe rotates pairs ``(2i, 2i+1)``, its first hd/4 pairs on x and band ``i``; timm's pair ``j`` is band ``j mod nb`` on
    the axis its grid lists first (``y_first``) or second, its channels ``(j, j + hd/2)`` (``half``) or ``(2j, 2j+1)``."""
    nb, perm = head_dim // 4, []
    for i in range(head_dim // 2):
        on_x, band = i < nb, i % nb
        j = band + (nb if on_x == y_first else 0)
        perm += [j, j + head_dim // 2] if half else [2 * j, 2 * j + 1]
    return torch.tensor(perm)


def timm_pos_embed(m: nn.Module) -> Tuple[str, Dict[str, Any], Optional[str], Optional[Tensor]]:
    """The vitpe PE computing what a timm model's position weights compute: ``(name, options, the model's coordinate mode
    (None: vitpe's default), q/k channel order)``. The mode is the model's, not pinned on the PE, so ``model.coord_mode``
    and ``eval.py --coord-mode`` move it; RoPE-ViT's two parts keep the two frames its reference evaluates in."""
    from timm.layers import RotaryEmbeddingMixed

    if isinstance(m, _timm_naflex()):
        return _naflex_pos_embed(m.embeds)
    rope = getattr(m, "rope", None)
    ape = getattr(m, "pos_embed", None) is not None
    relpos = getattr(m, "shared_rel_pos", None) or getattr(m.blocks[0].attn, "rel_pos", None)
    if relpos is not None:
        return (*_relpos(m, relpos), None, None)
    if rope is None:
        return ("learned", {"antialias": True}, None, None) if ape else ("none", {}, None, None)
    if isinstance(rope, RotaryEmbeddingMixed):
        if not ape:
            return "rope_mixed", {}, "extrapolate", None
        # RoPE-ViT's "+APE": the table is resized to the new grid (bicubic), RoPE keeps integer positions.
        return "learned+rope_mixed", {"learned.coord_mode": "interpolate", "learned.antialias": True, "rope_mixed.coord_mode": "extrapolate"}, None, None
    name, opts, mode, perm = _rope_layout(m, m.embed_dim // m.blocks[0].attn.num_heads)
    if not ape:
        return name, opts, mode, perm
    combined = {"learned.antialias": True, **{f"{name}.{k}": v for k, v in opts.items()}}
    if mode == "interpolate":
        return f"learned+{name}", combined, mode, perm
    # the table is resized (interpolated) while the RoPE reads its own frame: each part keeps its own mode
    return f"learned+{name}", {**combined, "learned.coord_mode": "interpolate", f"{name}.coord_mode": mode}, None, perm


# ---- weights ------------------------------------------------------------------------------------------------------
def _permute_qk(sd: Dict[str, Tensor], prefix: str, num_heads: int, perm: Tensor) -> None:
    """Reorder each head's q and k channels (rows of the fused projection, its bias, and the q/k norms) by ``perm``."""
    w = sd[prefix + "attn.qkv.weight"]
    hd = perm.numel()
    order = torch.arange(w.shape[0]).view(3, num_heads, hd)
    order[0], order[1] = order[0][:, perm], order[1][:, perm]
    order = order.flatten()
    for name in ("attn.qkv.weight", "attn.qkv.bias"):
        if prefix + name in sd:
            sd[prefix + name] = sd[prefix + name][order]
    for name in ("attn.q_norm.weight", "attn.q_norm.bias", "attn.k_norm.weight", "attn.k_norm.bias"):
        if prefix + name in sd:
            sd[prefix + name] = sd[prefix + name][perm]


def convert_timm_state_dict(sd: Dict[str, Tensor], num_heads: int = 0, perm: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """timm ViT/Eva parameter names and layouts -> vitpe's (position weights left under timm's names)."""
    out: Dict[str, Tensor] = {}
    blocks = sorted({k.split(".")[1] for k in sd if k.startswith("blocks.")}, key=int)
    for k, v in sd.items():
        if k.startswith("patch_embed.proj."):
            k = "patch_embed." + k[len("patch_embed.proj."):]
        elif k.startswith("blocks.") and k.endswith((".gamma_1", ".gamma_2")):  # Eva's LayerScale
            k = k[: -len("gamma_1")] + ("ls1.gamma" if k.endswith("1") else "ls2.gamma")
            if k.endswith("ls1.gamma") and k[: -len("ls1.gamma")] + "gamma_2" not in sd:  # sapiens2 scales the attention only
                out[k[: -len("ls1.gamma")] + "ls2.gamma"] = torch.ones_like(v)
        out[k] = v
    for b in blocks:
        p = f"blocks.{b}."
        a = p + "attn."
        if a + "q_proj.weight" in out:  # separate projections -> one fused qkv
            ws = [out.pop(a + f"{n}_proj.weight") for n in "qkv"]
            bs = [out.pop(a + f"{n}_proj.bias", None) for n in "qkv"]
            out[a + "qkv.weight"] = torch.cat(ws)
            if any(x is not None for x in bs):
                out[a + "qkv.bias"] = torch.cat([x if x is not None else torch.zeros(w.shape[0], dtype=w.dtype) for x, w in zip(bs, ws)])
        if a + "q_bias" in out:  # Eva's fused qkv with q and v biases (k has none)
            qb, vb = out.pop(a + "q_bias"), out.pop(a + "v_bias")
            kb = out.pop(a + "k_bias", None)
            out[a + "qkv.bias"] = torch.cat([qb, torch.zeros_like(qb) if kb is None else kb, vb])
        out.pop(a + "k_bias", None)
        m = p + "mlp."
        if m + "fc1_g.weight" in out:  # SwiGLU: act(fc1_g x) * fc1_x x == GLU with fc1 = [fc1_g; fc1_x]
            for t in ("weight", "bias"):
                if m + f"fc1_g.{t}" in out:
                    out[m + f"fc1.{t}"] = torch.cat([out.pop(m + f"fc1_g.{t}"), out.pop(m + f"fc1_x.{t}")])
        if perm is not None:
            _permute_qk(out, p, num_heads, perm)
    return out


def split_timm_state_dict(sd: Dict[str, Tensor], num_prefix_tokens: int, no_embed_class: bool = False, num_heads: int = 0,
                          perm: Optional[Tensor] = None, prefix_tokens: Tuple[str, ...] = ("cls_token", "dist_token", "reg_token")
                          ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """A timm ViT/Eva state dict -> (vitpe names of everything but the PE, timm's PE weights for
    :meth:`PosEmbed.from_timm`). Positions of prefix tokens are folded into the tokens (vitpe gives prefix tokens no
    position); ``pos_embed`` keeps only the patch positions."""
    def positional(k: str) -> bool:  # timm's position weights, handed to the PE to take or leave
        return k in _PE_KEYS or ".rel_pos." in k or k.startswith("shared_rel_pos.")

    out = convert_timm_state_dict({k: v for k, v in sd.items() if not positional(k)}, num_heads, perm)
    pe = {k: v for k, v in sd.items() if positional(k)}
    if "pos_embed" in pe and num_prefix_tokens:
        folded, pe["pos_embed"] = fold_prefix_positions(pe["pos_embed"], [out.get(n) for n in prefix_tokens], no_embed_class)
        out.update({n: t for n, t in zip(prefix_tokens, folded) if t is not None})
    return out, pe


def timm_to_vitpe_state_dict(sd: Dict[str, Tensor], grid: Size2, num_prefix_tokens: int, no_embed_class: bool = False) -> Dict[str, Tensor]:
    """Rename a timm ViT state dict for ``vitpe.VisionTransformer(pos_embed="learned")`` (table on ``grid``)."""
    from ..pos_embed import LearnedPosEmbed

    out, pe_weights = split_timm_state_dict(sd, num_prefix_tokens, no_embed_class)
    if "pos_embed" in pe_weights:
        dim = pe_weights["pos_embed"].shape[-1]
        out.update({f"pos_embed.{k}": v for k, v in LearnedPosEmbed(dim, 1, grid).from_timm(pe_weights).items()})
    return out


def load_timm_state_dict(model: VisionTransformer, state_dict: Dict[str, Tensor], no_embed_class: bool = False,
                         perm: Optional[Tensor] = None) -> None:
    """Load timm ViT (or Eva) weights into a vitpe ``VisionTransformer``.

    The model's PE takes the timm position weights it can (:meth:`PosEmbed.from_timm`: a learned table, RoPE-Mixed
    frequencies, Swin biases) and keeps its own parameters for the rest; everything else must match exactly, or
    ``CheckpointError`` says what does not. ``perm``: the q/k channel order of timm's rotary pairs (:func:`timm_pos_embed`).
    """
    from ..checkpoint import load_model_state

    sd, pe_weights = split_timm_state_dict(state_dict, model.num_prefix_tokens, no_embed_class, model.num_heads, perm)
    pe_state = {**model.pos_embed.state_dict(), **model.pos_embed.from_timm(pe_weights)}
    sd.update({f"pos_embed.{k}": v for k, v in pe_state.items()})
    load_model_state(model, sd, "timm state dict")


def vit_from_timm(timm_model: nn.Module, **overrides: Any) -> VisionTransformer:
    """A ``vitpe.VisionTransformer`` with the same architecture, weights and function as a timm model, at its size and,
    through vitpe's coordinates, at any other (docs/timm.md lists which timm models convert, and how each meets new sizes).

    Takes timm's ``VisionTransformer`` (ViT, DeiT, DeiT-III, distilled DeiT, CLIP, SigLIP, register tokens), ``Eva``
    (EVA-02, DINOv2/DINOv3 with registers, RoPE-ViT, Perception Encoder), ``VisionTransformerRelPos`` and ``NaFlexVit``
    (its 2D or factorized table, resized as timm resizes it for an image batch). Its position weights become the vitpe PE that
    computes them: a learned table (resized with timm's antialiasing; ``pos_embed_kwargs={"learned.antialias": False}``
    gives the papers' plain bicubic), RoPE-Mixed (extrapolated, as RoPE-ViT evaluates), DINOv3's RoPE (``rope_axial`` in
    normalize mode), EVA-02's (``rope_axial`` in interpolate mode). ``pos_embed=...`` among ``overrides`` swaps in another
    PE; it takes whatever timm weights it can and starts the rest fresh. Anything vitpe's ViT lacks raises one
    ``ValueError`` naming it.
    """
    if isinstance(timm_model, VisionTransformer):
        raise ValueError("this is already a vitpe.VisionTransformer: use it as it is (vit_from_timm converts timm's models)")
    m = unwrap(timm_model)
    if m is not timm_model:
        raise ValueError(f"this is a features_only model (timm's {type(timm_model).__name__}), which has no pooling or head: "
                         "convert the model built without features_only=True; vitpe's gives the same features "
                         "(forward_intermediates, or timm.create_model('vitpe_...', features_only=True))")
    if hasattr(m, "vitpe_pos_embed"):
        raise ValueError(f"this timm model already carries vitpe's {m.vitpe_pos_embed.name!r} PE (equip_timm_vit): vit_from_timm "
                         "takes a timm model as timm builds it; convert the model before equipping it, then pass pos_embed=... here")
    args = timm_architecture(m)
    pos_embed, pos_kwargs, mode, perm = timm_pos_embed(m)
    args.update(pos_embed=pos_embed, pos_embed_kwargs=pos_kwargs, **({"coord_mode": mode} if mode else {}))
    if "pos_embed" in overrides and "pos_embed_kwargs" not in overrides:
        args["pos_embed_kwargs"] = {}
    if "pos_embed" in overrides and overrides["pos_embed"] != pos_embed:
        perm = None  # another PE: timm's channel order stays as trained
    args.update(overrides)
    model = VisionTransformer(**args)
    naflex = isinstance(m, _timm_naflex())  # its table holds the patches only
    sd = _naflex_state_dict(m) if naflex else m.state_dict()
    load_timm_state_dict(model, sd, no_embed_class=naflex or getattr(m, "no_embed_class", False), perm=perm)
    return model.to(next(m.parameters()).device).eval()
