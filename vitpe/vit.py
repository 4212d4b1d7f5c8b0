"""A plain multi-head ViT (Dosovitskiy et al. 2021) whose positional encoding is injected from the top.

The model builds one PE object, asks it once per forward for a :class:`PosContext` on the grid of
the actual input, and hands that context to every block. No block knows which PE it runs with.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.nn.init import trunc_normal_
from torch.utils.checkpoint import checkpoint

from .coords import CoordAugment, CoordMode, PatchGrid, TokenGrid, content_tokens, snap, to_2tuple
from .layers import ACTIVATIONS, NORMS, AttentionPool, DropPath, LayerScale, Mlp, make_norm
from .packing import Packed
from .patch import resize_patch_embed
from .pos_embed import DEFAULT_POS_EMBED, PosContext, PosEmbed, build_pos_embed, check_pos_embed, pe_parts
from .suggest import did_you_mean

__all__ = ["POOLS", "Attention", "Block", "LayerScale", "VisionTransformer", "attend", "check_model_args", "compute_dtype", "position_tokens", "take_indices"]

POOLS = ("cls", "mean", "map")  # how the head reads the tokens: the class token, the mean of the patch tokens, an attention pool
FINAL_NORMS = ("tokens", "pooled", "none")  # where the last norm acts: on every token, on the pooled vector (timm's fc_norm), nowhere


def pin_traced_size(x: Tensor, dims: Tuple[int, int], pos_embed: PosEmbed) -> Tensor:
    """``x`` as it is. Under ``torch.jit.trace`` the graph computes coordinates, tables and rotations from its input's
    size (the sizes are traced values there, as in an ONNX export), so a traced model runs at any size; an encoding that
    makes a choice per size in Python (its :meth:`PosEmbed.size_choice` says which) gets a guard in the graph instead,
    which fails at any other size of ``x``'s ``dims``, and a warning that says so: never a wrong answer at another size."""
    if not torch.jit.is_tracing():
        return x
    why = pos_embed.size_choice()
    if why is None:
        return x
    h, w = (int(x.shape[d]) for d in dims)
    warnings.warn(f"torch.jit.trace fixes this {pos_embed.name!r} PE to this input's size ({h}x{w}) ({why}): the traced module "
                  "refuses other sizes ('shape [...] is invalid'); trace once per size, or run the model in Python at any size",
                  stacklevel=3)
    zero = torch.zeros(h, device=x.device, dtype=x.dtype).view(x.shape[dims[0]]).sum()
    return x + (zero + torch.zeros(w, device=x.device, dtype=x.dtype).view(x.shape[dims[1]]).sum())


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype activations will have: autocast's when it is on, else ``x``'s (PE tables are cast to it)."""
    kind = x.device.type  # a meta tensor (timm builds models on it to check their shapes) has no autocast
    return torch.get_autocast_dtype(kind) if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind) else x.dtype


def position_tokens(x: Tensor, pos: PosContext, prefix: Sequence[Optional[Tensor]]) -> Tensor:
    """The central rule of token assembly: add the PE's tokens to the patch tokens ``x`` ``(B, N, D)``, then put the
    prefix tokens (``(1, n, D)`` each: class, registers; None skipped) in front, which carry no position. A packed row
    gets one group of prefix tokens per image slot (``pos.grid.images_per_row``)."""
    x = pos.add_tokens(x)
    prefix = [t for t in prefix if t is not None]
    if not prefix:
        return x
    group = torch.cat(prefix, dim=1).repeat(1, pos.grid.images_per_row, 1)
    return torch.cat([group.expand(x.shape[0], -1, -1), x], dim=1)


def attend(
    q: Tensor, k: Tensor, v: Tensor, pos: Optional[PosContext], layer: int, dropout_p: float = 0.0, num_queries: Optional[int] = None,
    mixed: bool = False, x: Optional[Tensor] = None,
) -> Tensor:
    """Attention with the PE applied: rotate q and k, append the features a PE computes from the tokens, add the bias
    as a float mask, merge the heads. ``q, k, v``: ``(B, H, T, hd)`` -> ``(B, Q, H*hd)``. Shared by vitpe's and
    equipped timm attention. ``num_queries`` keeps only the first Q queries (``Q = T`` by default): the tokens whose
    outputs are used. ``mixed``: the PE's mix (STRING) was folded into the projection (:meth:`PosContext.fold_mix`).
    ``x``: the attention's input ``(B, T, dim)``, which a PE with query-key features reads."""
    bias = scale = None
    if pos is not None:
        q, k = pos.rotate(q, k, layer, mixed)
        if pos.extenders:
            if x is None:
                raise ValueError("this positional encoding reads each block's input (query-key features): pass x to attend")
            q, k, scale = pos.extend(q, k, x, layer)
        bias = pos.mask_at(layer)
        bias = bias if bias is None or bias.dtype == torch.bool else bias.to(q.dtype)  # bool: packed rows
        if bias is not None and bias.dim() == 3:
            # A shared grid's (heads, T, T) bias, given to SDPA as (1, heads, T, T): torch's CPU kernel takes its slow
            # math path for a 3-D mask (5.5x slower at 1,024 tokens) and its fused one for the same mask in 4-D.
            bias = bias[None]
    if num_queries is not None:
        q = q[:, :, :num_queries]
        bias = None if bias is None else bias[..., :num_queries, :]
    width = v.shape[-1]
    if q.shape[-1] > width:
        # A PE's query-key features make q and k wider than v, and torch's CPU kernel then takes its math path (7x
        # slower at 1,024 tokens, 58 against 32 features); zero columns of v give the same output on the fused one.
        v = F.pad(v, (0, q.shape[-1] - width))
    rows = _query_rows(q, k)
    if rows >= q.shape[-2]:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    else:  # softmax is per query: the same result, a piece at a time
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + rows], k, v, dropout_p=dropout_p, scale=scale,
                                                        attn_mask=None if bias is None else bias[..., i:i + rows, :])
                         for i in range(0, q.shape[-2], rows)], dim=-2)
    return rearrange(out[..., :width], "b h t d -> b t (h d)")


QUERY_CHUNK_SCORES = 1 << 27  # attention scores per SDPA call past which inference splits the queries (512 MiB in fp32)


def _query_rows(q: Tensor, k: Tensor) -> int:
    """Queries per SDPA call: all of them in training and export, else at most :data:`QUERY_CHUNK_SCORES` scores a call.
    At 1024 px one image's attention is minutes of a single call that neither Ctrl-C nor SIGTERM can interrupt (Python
    handles signals between calls) and whose scores, where the kernel writes them out, take tens of GiB."""
    t = q.shape[-2]
    if torch.is_grad_enabled() or torch.jit.is_tracing() or torch.jit.is_scripting():
        return t
    per_row = q.shape[0] * q.shape[1] * k.shape[-2]
    return max(1, min(t, QUERY_CHUNK_SCORES // max(per_row, 1)))


class Attention(nn.Module):
    """Multi-head self-attention with fused qkv through ``F.scaled_dot_product_attention``.

    Rotary encodings rotate q and k; bias encodings enter as a float mask (only then does SDPA leave
    its flash path). ``head_dim`` defaults to ``dim // num_heads``. ``qk_norm``: a norm over each head's q and k before
    the PE (ViT-22B, EVA's ``qk_norm``); ``out_norm``: a norm over the merged heads before ``proj`` (EVA-02's sub-LN).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        out_norm: bool = False,
        norm_layer: str = "layernorm",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        inner = self.num_heads * self.head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.q_norm = make_norm(norm_layer, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.k_norm = make_norm(norm_layer, self.head_dim, norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.norm = make_norm(norm_layer, inner, norm_eps) if out_norm else nn.Identity()
        self.proj = nn.Linear(inner, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.qk_norm = qk_norm

    def _split(self, x: Tensor, pos: Optional[PosContext] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``(B, H, T, hd)``; a PE's mix (STRING) is folded into the q and k projections on the way, unless
        q and k are normalised first (then :meth:`PosContext.rotate` mixes them after the norm)."""
        if pos is None or pos.mix is None or self.qk_norm:
            qkv = self.qkv(x)
        else:
            qkv = F.linear(x, *pos.fold_mix(self.qkv.weight, self.qkv.bias, self.num_heads))
        q, k, v = rearrange(qkv, "b t (s h d) -> s b h t d", s=3, h=self.num_heads).unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: Tensor, pos: Optional[PosContext] = None, layer: int = 0, num_queries: Optional[int] = None) -> Tensor:
        """``(B, T, dim) -> (B, Q, dim)``: outputs of the first ``num_queries`` tokens (all by default)."""
        out = attend(*self._split(x, pos), pos, layer, self.attn_drop if self.training else 0.0, num_queries,
                     mixed=not self.qk_norm, x=x)
        return self.proj_drop(self.proj(self.norm(out)))

    def attention_logits(self, x: Tensor, pos: Optional[PosContext] = None, layer: int = 0) -> Tensor:
        """The explicit (slow) path: ``q k^T / sqrt(d) + bias`` as ``(B, H, T, T)``, for inspection."""
        q, k, _ = self._split(x, pos)
        scale = None
        if pos is not None:
            q, k = pos.rotate(q, k, layer, mixed=not self.qk_norm)
            q, k, scale = pos.extend(q, k, x, layer)
        logits = q @ k.transpose(-2, -1) * (scale or 1 / math.sqrt(self.head_dim))
        mask = None if pos is None else pos.mask_at(layer)
        if mask is None:
            return logits
        if mask.dtype == torch.bool:
            return logits.masked_fill(~mask, float("-inf"))
        return logits + mask.to(logits.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + DropPath(LS(Attn(LN(x))))``, then ``x + DropPath(LS(MLP(LN(x))))``;
    LayerScale only with ``init_values`` (DeiT-III, RoPE-ViT), else the plain ViT block. ``post_norm``: the norms act on
    each branch's output instead, ``x + DropPath(LN(Attn(x)))`` (res-post-norm, Swin-V2's and timm's ``ResPostBlock``).
    The other options are the variants of the ViTs people load (:class:`VisionTransformer` names them)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        norm_eps: float = 1e-6,
        init_values: Optional[float] = None,
        norm_layer: str = "layernorm",
        mlp_act: str = "gelu",
        mlp_gated: bool = False,
        mlp_norm: bool = False,
        mlp_hidden_dim: Optional[int] = None,
        qk_norm: bool = False,
        attn_norm: bool = False,
        post_norm: bool = False,
    ) -> None:
        super().__init__()
        self.post_norm = post_norm
        self.norm1 = make_norm(norm_layer, dim, norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop, qk_norm=qk_norm,
                              out_norm=attn_norm, norm_layer=norm_layer, norm_eps=norm_eps)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = make_norm(norm_layer, dim, norm_eps)
        self.mlp = Mlp(dim, mlp_hidden_dim or int(dim * mlp_ratio), drop, act=mlp_act, gated=mlp_gated, norm=mlp_norm,
                       norm_layer=norm_layer, eps=norm_eps)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()

    def forward(self, x: Tensor, pos: Optional[PosContext] = None, layer: int = 0, num_queries: Optional[int] = None) -> Tensor:
        """``(B, T, dim) -> (B, Q, dim)``; ``num_queries=Q`` computes only the first Q tokens' outputs (they
        still attend to every token), e.g. the class token in the last block when the head reads only it."""
        shortcut = x if num_queries is None else x[:, :num_queries]
        if self.post_norm:
            x = shortcut + self.drop_path(self.ls1(self.norm1(self.attn(x, pos, layer, num_queries))))
            return x + self.drop_path(self.ls2(self.norm2(self.mlp(x))))
        x = shortcut + self.drop_path(self.ls1(self.attn(self.norm1(x), pos, layer, num_queries)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


def take_indices(depth: int, indices: Optional[Union[int, Sequence[int]]]) -> List[int]:
    """Block indices to return features of, as timm counts them: ``None`` all, an int ``n`` the last ``n``,
    a sequence those blocks (negative counts from the end). Out of range is a ``ValueError``."""
    if indices is None:
        return list(range(depth))
    if isinstance(indices, int):
        if not 0 < indices <= depth:
            raise ValueError(f"indices={indices} asks for the last {indices} of {depth} blocks; give 1..{depth}")
        return list(range(depth - indices, depth))
    out = [i + depth if i < 0 else i for i in indices]
    bad = [i for i, j in zip(indices, out) if not 0 <= j < depth]
    if bad:
        raise ValueError(f"block indices {bad} are out of range for a model of depth {depth}")
    return sorted(set(out))


# The numeric arguments and their ranges: a saved config with num_heads 0, depth -1, norm_eps -1 or a string for a
# width is one ValueError line here, not a ZeroDivisionError deep inside or NaN logits from a model that loads.
_WHOLE = {"patch_size": 1, "in_chans": 1, "num_classes": 0, "embed_dim": 1, "depth": 1, "num_heads": 1, "num_reg_tokens": 0,
          "mlp_hidden_dim": 1, "pool_heads": 1}  # name -> least value (None allowed where the default is None)
# name -> (lowest, highest, lowest included, highest included); None: the default None is allowed
_REAL = {"mlp_ratio": (0, math.inf, False, False), "norm_eps": (0, math.inf, False, False), "init_values": (0, math.inf, False, False),
         "content_keep": (0, 1, False, True), "drop_rate": (0, 1, True, False), "attn_drop_rate": (0, 1, True, False),
         "drop_path_rate": (0, 1, True, False)}


def _span(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    return f"{'[' if lo_in else '('}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{']' if hi_in else ')'}"


def check_model_args(args: Dict[str, Any]) -> None:
    """Every check of :class:`VisionTransformer`'s arguments that needs nothing built: ranges, choices, the shapes that
    must divide, the coordinate mode and augmentation, and the positional encoding's family and options
    (:func:`vitpe.pos_embed.check_pos_embed`). ``args`` may leave out arguments (their defaults are not checked). Raises
    a one-line ``ValueError`` that starts with the argument's name (``depth=0 is out of range; it must be in [1, inf)``):
    the model and a config file's ``model`` section (vitpe.config, when it is read) share these checks."""
    for name, least in _WHOLE.items():
        v = args.get(name)
        if v is None and (name not in args or name in ("mlp_hidden_dim", "pool_heads")):
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be a whole number, got {v!r}")
        if v < least:
            raise ValueError(f"{name}={v} is out of range; it must be in [{least}, inf)")
    for name, (lo, hi, lo_in, hi_in) in _REAL.items():
        v = args.get(name)
        if v is None and (name not in args or name == "init_values"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a number, got {v!r}")
        if not ((lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)):  # NaN fails both
            raise ValueError(f"{name}={v} is out of range; it must be in {_span(lo, hi, lo_in, hi_in)}")
    if "img_size" in args:
        img = to_2tuple(args["img_size"], "img_size")
        patch = args.get("patch_size", 16)
        if img[0] % patch or img[1] % patch:
            raise ValueError(f"img_size={args['img_size']} is not divisible by patch_size={patch}")
    for name, valid in (("pool", POOLS), ("final_norm", FINAL_NORMS), ("norm_layer", tuple(NORMS)), ("mlp_act", tuple(ACTIVATIONS))):
        if name in args and args[name] not in valid:
            raise ValueError(f"{name}={args[name]!r} is not valid{did_you_mean(args[name], valid)}; choose one of {', '.join(valid)}")
    pool, class_token = args.get("pool", "cls"), args.get("class_token", True)
    if pool == "cls" and not class_token:
        raise ValueError("pool='cls' needs class_token=True; use pool='mean' without a class token")
    if args.get("distilled") and pool != "cls":
        raise ValueError("distilled=True reads the class and distillation tokens: it needs pool='cls'")
    embed_dim, num_heads = args.get("embed_dim", 192), args.get("num_heads", 3)
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
    if "coord_mode" in args:
        CoordMode.parse(args["coord_mode"], "coord_mode")
    coord_aug = args.get("coord_aug") or {}
    names = [f.name for f in dataclasses.fields(CoordAugment)]
    unknown = sorted(set(coord_aug) - set(names))
    if unknown:
        raise ValueError(f"coord_aug.{unknown[0]} is not a coord_aug key{did_you_mean(unknown[0], names)}; valid keys: {', '.join(names)}")
    try:
        CoordAugment(**coord_aug)
    except TypeError:
        raise ValueError(f"coord_aug takes numbers for shift, rescale and jitter and true/false for per_image, got {coord_aug}") from None
    try:
        check_pos_embed(args.get("pos_embed", DEFAULT_POS_EMBED), args.get("pos_embed_kwargs") or {})
    except ValueError as e:
        raise ValueError(f"pos_embed={args.get('pos_embed', DEFAULT_POS_EMBED)!r}: {e}") from None


def parameter_estimate(args: Dict[str, Any]) -> int:
    """About how many parameters :class:`VisionTransformer` ``(**args)`` allocates (blocks, patch embedding, head), from
    its arguments alone: what a loader compares with the weights it holds before allocating a model a damaged config
    describes."""
    d, depth = int(args.get("embed_dim", 192)), int(args.get("depth", 12))
    hidden = args.get("mlp_hidden_dim") or int(d * float(args.get("mlp_ratio", 4.0)))
    hidden *= 2 if args.get("mlp_gated") else 1
    patch, chans = int(args.get("patch_size", 16)), int(args.get("in_chans", 3))
    return depth * (4 * d * d + 2 * d * hidden) + patch * patch * chans * d + int(args.get("num_classes", 1000)) * d


class VisionTransformer(nn.Module):
    """ViT with any registered positional encoding, running at any input size divisible by the patch.

    ``img_size`` fixes the *reference grid* (``img_size // patch_size``) in whose units coordinates are
    measured; inputs of other sizes get a new grid and new coordinates (``coord_mode``: ``"interpolate"``
    keeps the reference extent, ``"extrapolate"`` extends it, ``"normalize"`` puts centres in [-1, 1], ``"extend"``
    extrapolates the axes longer than trained and interpolates the others). ``pos_embed`` is a registry name or a
    '+'-combination (``vitpe.list_pos_embeds()``), ``pos_embed_kwargs`` its options. ``coord_aug``
    (``{"shift": .., "rescale": .., "jitter": ..}``, see :class:`CoordAugment`) perturbs the coordinates
    in training mode only. ``forward(x, patch_size=p)`` runs with a FlexiViT-resized patch embedding.
    ``init_values`` adds LayerScale to every block (DeiT-III, RoPE-ViT). ``content_keep=r`` keeps, in training and
    evaluation alike, the fraction ``r`` of each image's patch tokens that differ most from its background
    (:func:`vitpe.coords.content_tokens`): the flat background of an image costs no compute. ``forward_intermediates`` and
    ``feature_info`` follow timm's feature-extraction interface (``timm.create_model("vitpe_...", features_only=True)``).

    The variants of the ViTs people load (:func:`vitpe.vit_from_timm`), each off by default: ``norm_layer``
    (``"layernorm"``, ``"rmsnorm"``); ``mlp_act`` (``"gelu"``, ``"gelu_tanh"``, ``"quick_gelu"``, ``"silu"``), ``mlp_gated``
    (GLU: SwiGLU with ``"silu"``), ``mlp_norm`` (a norm inside the MLP), ``mlp_hidden_dim`` (overrides ``mlp_ratio``);
    ``qk_norm``; ``attn_norm`` (a norm on the attention output before its projection); ``patch_bias``; ``pre_norm`` (a norm
    on the tokens before the first block, CLIP's); ``final_norm`` (``"tokens"``; ``"pooled"``: after pooling, timm's
    ``fc_norm``; ``"none"``); ``pool="map"`` (an attention-pool head, SigLIP's, its MLP 4x wide; ``pool_heads`` its heads,
    the blocks' by default); ``pool_prefix`` (the mean or attention pool reads the prefix tokens too); ``distilled``
    (DeiT's distillation token and second head, averaged); ``post_norm`` (res-post-norm blocks, see :class:`Block`).
    """

    def __init__(
        self,
        img_size: Union[int, Tuple[int, int]] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        pos_embed: str = DEFAULT_POS_EMBED,
        pos_embed_kwargs: Optional[Dict[str, Any]] = None,
        class_token: bool = True,
        num_reg_tokens: int = 0,
        pool: Literal["cls", "mean", "map"] = "cls",
        coord_mode: str = CoordMode.INTERPOLATE,
        coord_aug: Optional[Dict[str, float]] = None,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_eps: float = 1e-6,
        init_values: Optional[float] = None,
        content_keep: float = 1.0,
        norm_layer: str = "layernorm",
        mlp_act: str = "gelu",
        mlp_gated: bool = False,
        mlp_norm: bool = False,
        mlp_hidden_dim: Optional[int] = None,
        qk_norm: bool = False,
        attn_norm: bool = False,
        patch_bias: bool = True,
        pre_norm: bool = False,
        final_norm: Literal["tokens", "pooled", "none"] = "tokens",
        pool_prefix: bool = False,
        pool_heads: Optional[int] = None,
        distilled: bool = False,
        post_norm: bool = False,
    ) -> None:
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        self.model_args: Dict[str, Any] = args  # what built it: vitpe.save_pretrained writes them (model.coord_mode as it is then)
        check_model_args(args)
        self.img_size = to_2tuple(img_size, "img_size")
        self.patch_size, self.in_chans, self.num_classes = patch_size, in_chans, num_classes
        self.embed_dim, self.depth, self.num_heads, self.pool = embed_dim, depth, num_heads, pool
        self.num_features = self.head_hidden_size = embed_dim  # timm's names for the width the head reads
        self.grad_checkpointing = False
        self.content_keep = content_keep
        self.ref_grid = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.coord_mode = coord_mode
        self.coord_aug = CoordAugment(**(coord_aug or {}))  # checked above
        self.num_prefix_tokens = int(class_token) + int(distilled) + num_reg_tokens
        self.pool_prefix, self.distilled = pool_prefix, distilled

        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, num_reg_tokens, embed_dim)) if num_reg_tokens else None
        self.pos_embed: PosEmbed = build_pos_embed(
            pos_embed, dim=embed_dim, num_heads=num_heads, ref_grid=self.ref_grid, depth=depth, **(pos_embed_kwargs or {})
        )
        costly = [p for p in pe_parts(self.pos_embed) if p.per_image_cost] if self.coord_aug.active and self.coord_aug.per_image else []
        for part in costly:  # what the family declares it costs to see coordinates per image
            warnings.warn(f"coord_aug draws per image, so {part.name} {part.per_image_cost} (docs/benchmarks.md, 'Coordinates per "
                          "image'); coord_aug per_image: false draws once per batch at no cost, as DINOv3 does", stacklevel=2)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # stochastic depth grows with depth (cpu: also under a meta device)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, dpr[i], norm_eps, init_values, norm_layer,
                  mlp_act, mlp_gated, mlp_norm, mlp_hidden_dim, qk_norm, attn_norm, post_norm)
            for i in range(depth)
        )
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=patch_size) for i in range(depth)]
        self.norm_pre = make_norm(norm_layer, embed_dim, norm_eps) if pre_norm else nn.Identity()
        self.norm = make_norm(norm_layer, embed_dim, norm_eps) if final_norm == "tokens" else nn.Identity()
        self.attn_pool = AttentionPool(embed_dim, pool_heads or num_heads, 4.0, mlp_act, norm_layer, norm_eps) if pool == "map" else None
        self.fc_norm = make_norm(norm_layer, embed_dim, norm_eps) if final_norm == "pooled" else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = nn.Linear(embed_dim, num_classes) if distilled and num_classes > 0 else (nn.Identity() if distilled else None)
        self._init_weights()

    @property
    def coord_mode(self) -> str:
        return self._coord_mode

    @coord_mode.setter
    def coord_mode(self, mode: str) -> None:
        self._coord_mode = CoordMode.parse(mode)

    def _init_weights(self) -> None:
        # timm's default ViT init: truncated-normal linears, zero biases, tiny prefix tokens.
        # The PE initialises itself, as its paper does.
        pe_modules = set(self.pos_embed.modules())
        for m in self.modules():
            if isinstance(m, nn.Linear) and m not in pe_modules:
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for t in (self.cls_token, self.dist_token, self.reg_token):
            if t is not None:
                nn.init.normal_(t, std=1e-6)

    def no_weight_decay(self) -> set:
        """Parameter names that should not be weight-decayed (timm's optimizer factory reads this)."""
        skip = {n for n in ("cls_token", "dist_token", "reg_token") if getattr(self, n) is not None}
        return skip | {f"pos_embed.{n}" for n, _ in self.pos_embed.named_parameters()}

    # ---- timm's model contract: what its optimizer helpers (layer decay) and fine-tuning scripts read -----------
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """Parameter groups from input to output, as timm's models give them: the embeddings (patches, prefix tokens, PE)
        first, then each block; what no pattern names (the head, its norm and pool) is the last group. timm's layer-wise
        learning-rate decay (``create_optimizer_v2(..., layer_decay=...)``) reads this."""
        return dict(stem=r"^cls_token|^dist_token|^reg_token|^pos_embed|^patch_embed|^norm_pre",
                    blocks=r"^blocks\.(\d+)" if coarse else [(r"^blocks\.(\d+)", None), (r"^norm\.", (99999,))])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in the backward pass instead of keeping them (less memory, ~30% more
        compute), as timm's models do."""
        self.grad_checkpointing = enable

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new, freshly initialised head for ``num_classes`` outputs (0: none, the model returns pooled features), as
        timm's ``reset_classifier``; ``global_pool`` another pooling (``"token"``/``"cls"``, ``"avg"``/``"mean"``, or
        ``"map"`` where the model has an attention pool). The head is made on the model's device and dtype, and
        ``model_args`` follow, so that a saved model is rebuilt with its new head."""
        if global_pool is not None:
            pool = {"token": "cls", "avg": "mean"}.get(global_pool, global_pool)
            if pool not in POOLS or (pool == "map" and self.attn_pool is None) or (pool == "cls" and self.cls_token is None):
                have = ["cls"] * (self.cls_token is not None) + ["mean"] + ["map"] * (self.attn_pool is not None)
                raise ValueError(f"global_pool={global_pool!r} is not a pooling this model has; choose one of {', '.join(have)}")
            self.pool = self.model_args["pool"] = pool
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        like = self.patch_embed.weight

        def linear() -> nn.Module:
            if num_classes == 0:
                return nn.Identity()
            head = nn.Linear(self.embed_dim, num_classes, device=like.device, dtype=like.dtype)
            if like.device.type != "meta":
                trunc_normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)
            return head.train(self.training)

        self.head = linear()
        if self.distilled:
            self.head_dist = linear()
        self.num_classes = self.model_args["num_classes"] = num_classes

    # ---- forward ---------------------------------------------------------------------------------
    def grid_size(self, img_hw: Tuple[int, int], patch_size: Optional[int] = None) -> Tuple[int, int]:
        """Token grid of an input of size ``(H, W)``; ``ValueError`` if not a multiple of the patch."""
        h, w = img_hw
        p = patch_size or self.patch_size
        if h % p or w % p or h < p or w < p:
            fix = (snap(h, p), snap(w, p))
            raise ValueError(f"input size {h}x{w} is not a multiple of patch_size {p}; resize or crop it, e.g. to {fix[0]}x{fix[1]}")
        return h // p, w // p

    def patch_grid(self, grid_size: Tuple[int, int], device: torch.device) -> PatchGrid:
        return PatchGrid.create(grid_size, self.ref_grid, self.coord_mode, device=device)

    def _check_input(self, x: Tensor) -> Tensor:
        """``x`` checked, in the dtype of the model's weights (a half-precision batch into a float32 model computes in
        float32, as a float32 batch into a float64 model computes in float64; autocast still decides inside)."""
        if x.dim() != 4:
            raise ValueError(f"expected images of shape (B, {self.in_chans}, H, W), got shape {tuple(x.shape)}")
        if x.shape[1] != self.in_chans:
            raise ValueError(
                f"expected {self.in_chans} input channels, got {x.shape[1]} (shape {tuple(x.shape)}); "
                f"convert the images or build the model with in_chans={x.shape[1]}"
            )
        if not x.is_floating_point():
            raise ValueError(f"expected floating-point images, got {x.dtype}; normalize them first "
                             "(vitpe.data.augment.normalize(images, mean, std) takes uint8 images)")
        return pin_traced_size(x.to(self.patch_embed.weight.dtype), (-2, -1), self.pos_embed)

    def patchify(self, x: Tensor, patch_size: Optional[int] = None) -> Tensor:
        """Patch embedding ``(B, C, H, W) -> (B, D, H/p, W/p)``; another ``patch_size`` PI-resizes the kernel."""
        if patch_size is None or patch_size == self.patch_size:
            return self.patch_embed(x)
        weight = self.patch_embed.weight
        key = (patch_size, weight.device, weight.dtype, weight._version)
        if torch.is_grad_enabled() and weight.requires_grad:
            resized = resize_patch_embed(weight, patch_size)  # training: rebuilt each step, gradients flow
        else:
            if getattr(self, "_flexi_cache", (None,))[0] != key:
                self._flexi_cache = (key, resize_patch_embed(weight, patch_size))
            resized = self._flexi_cache[1]
        return F.conv2d(x, resized, self.patch_embed.bias, stride=patch_size)

    def embed(
        self, x: Union[Tensor, Packed], grid: Optional[Union[PatchGrid, TokenGrid]] = None, patch_size: Optional[int] = None,
        token_keep: Optional[float] = None,
    ) -> Tuple[Tensor, PosContext]:
        """Patch tokens with prefix tokens, and the PE context for this input: ``(B, T, D)``.

        ``x``: images ``(B, C, H, W)``, or a :class:`~vitpe.packing.Packed` batch of images of mixed sizes. ``grid``: the
        coordinates (default: the input's grid in the model's coordinate mode); a :class:`TokenGrid` gives them per
        image and, with cells, selects which patches become tokens. ``token_keep=r`` keeps a random fraction ``r`` of
        each image's patch tokens (FLIP; a different subset per image). ``coord_aug`` applies in training mode."""
        if token_keep is not None and not 0 < token_keep <= 1:
            raise ValueError(f"token_keep must be in (0, 1], got {token_keep}: the fraction of each image's patch tokens to keep")
        if isinstance(x, Packed):
            if self.content_keep < 1:
                raise ValueError(f"this model keeps the {self.content_keep:g} of each image's patches with the most content; a packed "
                                 "batch brings its own tokens: call it with image batches (eval.py without --native)")
            if grid is not None or token_keep is not None or patch_size not in (None, self.patch_size) or x.patch_size != self.patch_size:
                raise ValueError(f"a packed batch brings its own grid and tokens at patch_size {x.patch_size}: call the model with it "
                                 f"alone (model patch_size {self.patch_size}); drop tokens with pack_images(..., token_keep=r)")
            weight = self.patch_embed.weight
            if x.patches.shape[-1] != weight[0].numel():
                raise ValueError(f"packed patches have {x.patches.shape[-1]} values, the model's patches {weight[0].numel()} "
                                 f"({self.in_chans} channels x {self.patch_size}x{self.patch_size})")
            tokens = F.linear(x.patches, weight.flatten(1), self.patch_embed.bias)  # the patch convolution, patch by patch
            grid = x.grid.rebased(self.ref_grid, self.coord_mode)
            if self.training and self.coord_aug.active:
                grid = self.coord_aug(grid)
        else:
            x = self._check_input(x)
            b, grid_hw = x.shape[0], self.grid_size(x.shape[-2:], patch_size)
            made = grid is None
            if made:
                grid = self.patch_grid(grid_hw, x.device)
            else:
                self._check_grid(grid, b, grid_hw)
            if made and self.training and self.coord_aug.active:
                grid = self.coord_aug(grid, b)
            if self.content_keep < 1 and not grid.batched:  # in training and evaluation alike; a per-image grid selects its own
                grid = TokenGrid.from_grid(grid, b).take(content_tokens(x, patch_size or self.patch_size, self.content_keep))
            if token_keep is not None and token_keep < 1:
                grid = (grid if grid.batched else TokenGrid.from_grid(grid, b)).keep_random(token_keep)
            tokens = rearrange(self.patchify(x, patch_size), "b d h w -> b (h w) d")  # (B, N, D)
            if grid.batched and grid.cells is not None:  # the tokens the grid names (all of them, or those kept)
                index = grid.cells[..., 1] * grid_hw[1] + grid.cells[..., 0]
                tokens = tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1]))
        num_prefix = self.num_prefix_tokens * grid.images_per_row
        pos = self.pos_embed.context(grid, num_prefix, compute_dtype(tokens))
        x = position_tokens(tokens, pos, (self.cls_token, self.dist_token, self.reg_token))
        return self.norm_pre(self.pos_drop(x)), pos

    @staticmethod
    def _check_grid(grid: Union[PatchGrid, TokenGrid], batch: int, grid_hw: Tuple[int, int]) -> None:
        if not grid.batched:
            if grid.size != grid_hw:
                raise ValueError(f"grid {grid.size} does not match the input's token grid {grid_hw}")
            return
        b, n = grid.coords.shape[:2]
        if b != batch:
            raise ValueError(f"per-image coordinates are for {b} images, the batch has {batch}")
        if grid.cells is None and n != grid_hw[0] * grid_hw[1]:
            raise ValueError(f"per-image coordinates give {n} tokens per image, the input has {grid_hw[0]}x{grid_hw[1]} patches; "
                             "give (B, N, 2) with N = patches, or a TokenGrid with cells to select tokens")
        if grid.cells is not None and ((grid.cells >= grid.cells.new_tensor(grid_hw[::-1])).any() or (grid.cells < 0).any()):
            raise ValueError(f"per-image grid cells lie outside the input's {grid_hw[0]}x{grid_hw[1]} patch grid")

    def run_blocks(self, x: Tensor, pos: PosContext, stop: Optional[int] = None, num_queries: Optional[int] = None) -> Iterator[Tensor]:
        """The one block loop: yields the tokens after each block (and its conditional PE), through block ``stop``
        (default: the last). ``num_queries=Q`` computes only the first Q tokens' outputs in the last block run."""
        last = len(self.blocks) - 1 if stop is None else stop
        save_memory = self.grad_checkpointing and torch.is_grad_enabled()
        for i, blk in enumerate(self.blocks[: last + 1]):
            run = functools.partial(checkpoint, blk, use_reentrant=False) if save_memory else blk
            if i == last and num_queries is not None:
                yield run(x, pos, i, num_queries)  # conditioning after it would touch only the patch tokens dropped here
            else:
                x = pos.after_block(i, run(x, pos, i))
                yield x

    def forward_features(
        self, x: Union[Tensor, Packed], grid: Optional[Union[PatchGrid, TokenGrid]] = None, patch_size: Optional[int] = None,
        num_queries: Optional[int] = None, token_keep: Optional[float] = None,
    ) -> Tensor:
        """``(B, C, H, W) -> (B, T, D)``, normalised, ``T = num_prefix_tokens + (H/p)(W/p)``. With ``num_queries=Q``
        the last block computes only the first Q tokens' outputs, ``(B, Q, D)``: all a class-token head reads."""
        x, pos = self.embed(x, grid, patch_size, token_keep)
        for x in self.run_blocks(x, pos, num_queries=num_queries):
            pass
        return self.norm(x)

    def forward_intermediates(
        self,
        x: Tensor,
        indices: Optional[Union[int, Sequence[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        grid: Optional[PatchGrid] = None,
        patch_size: Optional[int] = None,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Any]]]:
        """Features after the blocks in ``indices`` (timm's meaning: None all, n the last n, or a list), as timm's
        ``forward_intermediates``: ``NCHW`` maps ``(B, D, H/p, W/p)`` or ``NLC`` tokens, each ``(patches, prefix)``
        with ``return_prefix_tokens``. Returns ``(final features, intermediates)``, or only the intermediates."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take = take_indices(len(self.blocks), indices)
        if output_fmt == "NCHW" and (isinstance(x, Packed) or (grid is not None and grid.batched) or self.content_keep < 1):
            raise ValueError("per-image, content-selected or packed tokens do not form one (H, W) map: use output_fmt='NLC'")
        hw = self.grid_size(x.shape[-2:], patch_size) if isinstance(x, Tensor) and x.dim() == 4 else None
        x, pos = self.embed(x, grid, patch_size)
        p = self.num_prefix_tokens
        out = []
        stop = take[-1] if stop_early or intermediates_only else None
        for i, x in enumerate(self.run_blocks(x, pos, stop)):
            if i in take:
                y = self.norm(x) if norm else x
                patches = y[:, p:]
                if output_fmt == "NCHW":
                    patches = rearrange(patches, "b (h w) d -> b d h w", h=hw[0], w=hw[1]).contiguous()
                out.append((patches, y[:, :p]) if return_prefix_tokens else patches)
        return out if intermediates_only else (self.norm(x), out)

    def prune_intermediate_layers(
        self, indices: Optional[Union[int, Sequence[int]]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drop the blocks after the last of ``indices`` (timm's feature-extraction interface); returns the indices."""
        take = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: take[-1] + 1]
        self.feature_info = self.feature_info[: take[-1] + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.head = nn.Identity()
        return take

    def forward_head(self, x: Tensor, pre_logits: bool = False, grid: Optional[Union[PatchGrid, TokenGrid]] = None) -> Tensor:
        """Pool (class token, mean of the patch tokens or attention pool) and classify. ``grid``: a packed batch's, pooled
        per image. A distilled model averages its two heads' logits, as DeiT evaluates (``pre_logits``: the class token's)."""
        pooled = self.head_drop(self.fc_norm(self.pool_tokens(x, grid)))
        if pre_logits:
            return pooled
        if self.distilled:
            return (self.head(pooled) + self.head_dist(self.head_drop(self.fc_norm(x[:, 1])))) / 2
        return self.head(pooled)

    def pool_tokens(self, x: Tensor, grid: Optional[Union[PatchGrid, TokenGrid]] = None) -> Tensor:
        """``(B, T, D) -> (images, D)``: one vector per image; a packed row holds several, returned in input order."""
        p = self.num_prefix_tokens
        if grid is None or not grid.batched or grid.segments is None:
            if self.pool == "cls":
                return x[:, 0]
            tokens = x if self.pool_prefix else x[:, p:]
            return tokens.mean(dim=1) if self.pool == "mean" else self.attn_pool(tokens)
        if self.pool == "map" or self.pool_prefix or self.distilled:
            raise ValueError("an attention-pool, prefix-pooling or distilled head reads each image's tokens as one sequence: call "
                             "the model with image batches, not a packed batch")
        k = grid.images_per_row
        rows, slots = grid.images.unbind(-1)
        if self.pool == "cls":
            return x[:, : k * p : p][rows, slots]  # slot j's class token leads its prefix group
        b, n, d = x[:, k * p :].shape
        seg = grid.segments
        ids = torch.where(seg < 0, b * k, torch.arange(b, device=x.device)[:, None] * k + seg).flatten()
        sums = x.new_zeros(b * k + 1, d).index_add(0, ids, x[:, k * p :].reshape(b * n, d))
        counts = x.new_zeros(b * k + 1).index_add(0, ids, x.new_ones(b * n)).clamp(min=1)
        return (sums / counts[:, None])[rows * k + slots]

    def forward(
        self, x: Union[Tensor, Packed], grid: Optional[Union[PatchGrid, TokenGrid]] = None, patch_size: Optional[int] = None,
        token_keep: Optional[float] = None,
    ) -> Tensor:
        """Logits ``(B, num_classes)`` for images of any size divisible by the patch size (or ``patch_size``), or
        ``(images, num_classes)`` in input order for a :class:`~vitpe.packing.Packed` batch of mixed sizes."""
        x, pos = self.embed(x, grid, patch_size, token_keep)
        # A class-token head reads only the class tokens, and the last block's other outputs feed nothing: compute that
        # block for the leading tokens up to the last class token alone (same logits and gradients, ~9/12 of it saved).
        last_cls = (pos.grid.images_per_row - 1) * self.num_prefix_tokens + 1 + int(self.distilled)
        for x in self.run_blocks(x, pos, num_queries=last_cls if self.pool == "cls" else None):
            pass
        return self.forward_head(self.norm(x), grid=pos.grid)
