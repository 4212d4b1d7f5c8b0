"""One interface for every positional encoding, and the per-forward context the blocks consume.

A PE answers up to four questions about a :class:`~vitpe.coords.PatchGrid`; the defaults answer
"nothing", so a model calls all of them and never branches on which PE it holds:

- ``tokens(grid)``: ``(N, dim)`` added to the patch tokens (absolute encodings);
- ``bias(grid)``: ``(heads, N, N)`` added to the attention logits (relative encodings);
- ``rope_angles(grid)``: ``(L|1, heads|1, N, head_dim/2)`` rotation angles for q and k (rotary);
- ``rope_rotations(grid)``: ``(L|1, heads|1, N, K, b, b)`` block rotation matrices for q and k (learned matrix rotations);
- ``rope_mix()``: ``(heads, head_dim, head_dim)`` an orthogonal map applied to q and k before rotating (STRING);
- ``rope_magnitude(grid)``: ``(N,)`` a factor on q and k per token (YaRN's temperature);
- ``condition(layer, x, grid)``: a function of the tokens themselves after block ``layer`` (conditional);
- ``qk_features(layer, x, grid)``: features appended to the queries and keys of block ``layer``, computed from its input
  ``x`` (a position term whose shape the token's content chooses).

``bias(grid)`` may also be per layer, ``(L, heads, N, N)`` (a penalty that changes with depth).

The grid is a :class:`~vitpe.coords.PatchGrid` shared by the batch (the shapes above, cached), or a
:class:`~vitpe.coords.TokenGrid` with coordinates per image ``(B, N, 2)``: then every answer gains a leading batch
dimension, ``(B, N, dim)``, ``(B, heads, N, N)``, ``(B, L|1, heads|1, N, head_dim/2)``, and nothing is cached.

Every PE also takes the option ``coord_mode`` (``None``: the model's): a part of a combination may read
its coordinates in its own mode, as RoPE-ViT's "+APE" models interpolate the table and extrapolate RoPE.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Hashable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..coords import PatchGrid, Size2, to_2tuple
from .functional import blocks_to_dense, rotate_blocks, rotate_complex, rotate_dense, rotate_pairs

__all__ = ["PosEmbed", "PosContext", "PEOption"]

_CACHE_ENTRIES = 32  # cached tables per PE: multi-resolution training cycles through a handful of grids


@dataclass
class PosContext:
    """What one forward pass needs from the PE, computed once and shared by every block.

    ``bias`` is ``(heads|1, T, T)`` and ``cos``/``sin`` are ``(L|1, heads|1, T, head_dim/2)`` over all
    ``T = num_prefix + N`` tokens: prefix (cls/register) tokens get zero bias and the identity rotation,
    so they carry no position and never shift the grid. With per-image coordinates they are ``(B, heads, T, T)``
    and ``(L|1, B, heads|1, T, head_dim/2)``. ``mask`` is what attention adds to its logits: the bias, and for a
    packed row (images told apart by ``grid.segments``) ``-inf`` between images (a bool mask if there is no bias).
    """

    grid: PatchGrid
    num_prefix: int
    tokens: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    cos: Optional[Tensor] = None
    sin: Optional[Tensor] = None
    rot: Optional[Tensor] = None  # cos + i sin, for float32/float64: the faster complex-product rotation
    mats: Optional[Tensor] = None  # block rotations instead of cos/sin: (L|1, B, heads|1, T, K, b, b), shared (L|1, heads, T, hd, hd)
    mix: Optional[Tensor] = None  # (heads, head_dim, head_dim) orthogonal map before the rotation (see fold_mix)
    conditionals: Tuple["PosEmbed", ...] = ()  # encodings that act on the tokens after some blocks, in order
    extenders: Tuple["PosEmbed", ...] = ()  # encodings that append features to q and k from each block's input
    condition_layers: FrozenSet[int] = frozenset()
    mask: Optional[Tensor] = None
    mask_per_layer: bool = False  # mask is (L, ...): one per block
    _layers: Optional[tuple] = field(default=None, repr=False)
    _masks: Optional[tuple] = field(default=None, repr=False)

    def add_tokens(self, x: Tensor) -> Tensor:
        """``x``: ``(B, N, dim)`` patch tokens (no prefix)."""
        return x if self.tokens is None else x + self.tokens

    def fold_mix(self, weight: Tensor, bias: Optional[Tensor], num_heads: int) -> Tuple[Tensor, Optional[Tensor]]:
        """A fused qkv projection's ``weight`` ``(3 H hd, dim)`` and ``bias`` with :attr:`mix` folded into its q and k rows
        (STRING's ``P W_q``, ``P W_k``): the mix then costs a ``hd x hd x dim`` product per head instead of one per token."""
        def fold(t: Tensor) -> Tensor:
            q, k, v = t.unflatten(0, (3, num_heads, -1)).unbind(0)  # (H, hd, ...)
            q, k = (torch.einsum("hij,hj...->hi...", self.mix.to(t.dtype), z) for z in (q, k))
            return torch.stack([q, k, v]).flatten(0, 2)

        return fold(weight), None if bias is None else fold(bias)

    def rotate(self, q: Tensor, k: Tensor, layer: int, mixed: bool = False) -> Tuple[Tensor, Tensor]:
        """``q, k``: ``(B, heads, T, head_dim)``; ``mixed``: :attr:`mix` is already in them (:meth:`fold_mix`)."""
        if self.mix is not None and not mixed:
            mix = self.mix.to(q.dtype).transpose(-1, -2)
            q, k = q @ mix, k @ mix
        first = self.cos if self.mats is None else self.mats
        if first is None:
            return q, k
        i = min(layer, first.shape[0] - 1)
        if self._layers is None:
            # One split for all blocks: indexing [i] in each block would make autograd build a zero tensor of the full
            # (L, B, heads, T, P) per block in backward; unbind's backward is a single stack.
            self._layers = tuple(t.unbind(0) if t is not None else None for t in (self.rot, self.cos, self.sin, self.mats))
        rot, cos, sin, mats = (t if t is None else t[i] for t in self._layers)
        if mats is not None:
            mats = mats.to(q.dtype)
            if self.grid.batched:
                return rotate_blocks(q, mats), rotate_blocks(k, mats)
            return rotate_dense(torch.stack([q, k]), mats).unbind(0)
        if rot is not None and q.dtype == k.dtype == self.cos.dtype:
            return rotate_complex(q, rot), rotate_complex(k, rot)
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)  # half precision: complex32 is not supported everywhere

    def mask_at(self, layer: int) -> Optional[Tensor]:
        """What block ``layer`` adds to its attention logits (``None``: nothing): the float bias, or a bool mask."""
        if not self.mask_per_layer:
            return self.mask
        if self._masks is None:
            self._masks = self.mask.unbind(0)  # one split, as in rotate
        return self._masks[min(layer, len(self._masks) - 1)]

    def after_block(self, layer: int, x: Tensor) -> Tensor:
        """``x``: ``(B, T, dim)``; applies the conditional encodings of block ``layer`` to the patch tokens only."""
        if layer not in self.condition_layers:
            return x
        p, patches = self.num_prefix, x[:, self.num_prefix:]
        for pe in self.conditionals:
            if layer in pe.condition_layers():
                patches = pe.condition(layer, patches, self.grid)
        return torch.cat([x[:, :p], patches], dim=1)

    def extend(self, q: Tensor, k: Tensor, x: Tensor, layer: int) -> Tuple[Tensor, Tensor, Optional[float]]:
        """``q, k`` ``(B, heads, T, head_dim)`` with the features of every encoding in :attr:`extenders` appended (zeros
        for the prefix tokens, which carry no position), from the attention's input ``x`` ``(B, T, dim)``; and the
        scale that keeps ``q . k``'s own ``1 / sqrt(head_dim)`` (None: nothing appended, the kernel's default)."""
        if not self.extenders:
            return q, k, None
        p = self.num_prefix
        extras = [pe.qk_features(layer, x[:, p:], pe.own_grid(self.grid)) for pe in self.extenders]
        qe, ke = (F.pad(torch.cat(t, -1), (0, 0, p, 0)).to(q.dtype) for t in zip(*extras))
        return torch.cat([q, qe.expand(*q.shape[:-1], -1)], -1), torch.cat([k, ke.expand(*k.shape[:-1], -1)], -1), q.shape[-1] ** -0.5

    @classmethod
    def merge(cls, contexts: Sequence["PosContext"]) -> "PosContext":
        """One context from those of a combination's parts (each built on its own coordinates), one rule per
        mechanism: token terms add up, biases add up (per block where any is), the rotation is the rotary part's (a
        combination has at most one), conditional parts apply in turn; the mask follows from the summed bias."""
        first = contexts[0]
        out = cls(first.grid, first.num_prefix)
        out.tokens = _sum([c.tokens for c in contexts])
        out.bias = _sum([c.bias for c in contexts])
        out.mask_per_layer = any(c.mask_per_layer for c in contexts)
        for name in _ROTATION:
            setattr(out, name, next((getattr(c, name) for c in contexts if getattr(c, name) is not None), None))
        out.conditionals = tuple(pe for c in contexts for pe in c.conditionals)
        out.extenders = tuple(pe for c in contexts for pe in c.extenders)  # their features side by side: the terms add
        out.condition_layers = frozenset().union(*(c.condition_layers for c in contexts))
        out.mask = _attention_mask(out.bias, out.grid, out.num_prefix)
        return out


_ROTATION = ("cos", "sin", "rot", "mats", "mix")  # what the one rotary part of a combination brings, as it built it


def _sum(values: Sequence[Optional[Tensor]]) -> Optional[Tensor]:
    values = [v for v in values if v is not None]
    return None if not values else values[0] if len(values) == 1 else torch.stack(torch.broadcast_tensors(*values)).sum(0)


def _attention_mask(bias: Optional[Tensor], grid: PatchGrid, num_prefix: int) -> Optional[Tensor]:
    """What attention adds to its logits: the bias, and for a packed row ``-inf`` between images (a bool mask if there
    is no bias)."""
    if not (grid.batched and grid.segments is not None):
        return bias
    same = _same_image(grid.segments, num_prefix, grid.images_per_row)
    return same if bias is None else bias.masked_fill(~same, float("-inf"))


def _same_image(segments: Tensor, num_prefix: int, images_per_row: int) -> Tensor:
    """``(B, 1, T, T)`` bool: which tokens of a packed row may attend to which. The row's ``num_prefix`` prefix tokens
    are ``images_per_row`` groups (one per image slot, in slot order) before the patch tokens, whose slot is
    ``segments`` ``(B, N)``; padding (slot -1, and prefix groups of empty slots) attends only to padding."""
    per = num_prefix // images_per_row
    used = segments.amax(1, keepdim=True) + 1  # (B, 1) images in each row
    slots = torch.arange(images_per_row, device=segments.device).repeat_interleave(per)[None]  # (1, K * per)
    ids = torch.cat([torch.where(slots < used, slots, -1), segments], 1)  # (B, T)
    return (ids[:, :, None] == ids[:, None, :])[:, None]


def _layers_first(t: Tensor, batched: bool, extra: int = 0) -> Tensor:
    """Rotary tables ``([B], [L], [heads], N, P)`` (``extra`` more trailing dimensions for matrices) as
    ``(L, [B], heads, N, P)``: the block picks its layer first."""
    core = 2 + extra  # N, P (and the matrix dimensions)
    if batched:
        while t.dim() < 3 + core:
            t = t.unsqueeze(1)
        t = t.transpose(0, 1)
    while t.dim() < 2 + core:
        t = t.unsqueeze(0)
    return t


def _per_token(m: Tensor, batched: bool, extra: int) -> Tensor:
    """A per-token factor ``([B], T)`` shaped to multiply ``(L, [B], heads, T, *extra)`` tables."""
    m = m[:, None] if batched else m  # ([B], 1 heads, T)
    return m.reshape(*m.shape, *([1] * extra))


@dataclass(frozen=True)
class PEOption:
    """A setting of a trained encoding that may change at test time, declared by its family (``test_options``): ``name``
    is what users write (``eval.py --pe-option FAMILY.NAME=VALUE``, :func:`vitpe.set_pe_option`), ``attr`` the attribute
    that holds it (its setter checks the value), ``parse`` turns a command line's text into a value, ``help`` says what
    it does. ``flag``: an ``eval.py`` flag of its own, kept from before ``--pe-option``."""

    name: str
    attr: str
    parse: Callable[[str], Any]
    help: str
    flag: Optional[str] = None


class PosEmbed(nn.Module):
    """Base class of every positional encoding. Subclasses override the hooks they implement, and declare what they
    are in the class attributes below: the model, the registry, ``eval.py`` and the studies read these declarations
    instead of naming families.

    Constructor contract (what ``build_pos_embed`` passes): ``dim`` (model width), ``num_heads``,
    ``ref_grid`` (the token grid the model is built for), ``depth`` (number of blocks), then the
    encoding's own keyword options.
    """

    name: ClassVar[str] = ""
    acts_on: ClassVar[str] = "-"  # "tokens" | "attention logits" | "q and k" | "tokens (conditional)"
    reads_coords: ClassVar[bool] = True  # False: a function of the tokens alone (no coordinate mode or augmentation applies)
    # What coordinates per image (coord_aug drawn per image, token dropping, packing) cost this family beyond a shared
    # grid, where that makes a draw per batch the affordable way ("" where they cost little): a sentence after its name.
    per_image_cost: ClassVar[str] = ""
    cost_note: ClassVar[str] = ""  # anything else it costs beyond the model (compute, memory), a sentence after its name
    test_options: ClassVar[Tuple[PEOption, ...]] = ()  # settings a trained model may change at test time

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads}")
        self.dim, self.num_heads, self.depth = dim, num_heads, depth
        self.head_dim = dim // num_heads
        self.ref_grid = to_2tuple(ref_grid, "ref_grid")
        self.coord_mode: Optional[str] = None  # set by build_pos_embed(..., coord_mode=...); None: the grid's own
        self._memo_store: "OrderedDict[Hashable, object]" = OrderedDict()

    # ---- hooks -----------------------------------------------------------------------------------
    def tokens(self, grid: PatchGrid) -> Optional[Tensor]:
        return None

    def bias(self, grid: PatchGrid) -> Optional[Tensor]:
        return None

    def rope_angles(self, grid: PatchGrid) -> Optional[Tensor]:
        return None

    def rope_rotations(self, grid: PatchGrid) -> Optional[Tensor]:
        return None

    @property
    def rotary(self) -> bool:
        """Whether this encoding rotates q and k (then it takes the extrapolation controls ``scaling``, ``p_rope``)."""
        return type(self).rope_angles is not PosEmbed.rope_angles or type(self).rope_rotations is not PosEmbed.rope_rotations

    @property
    def biased(self) -> bool:
        """Whether this encoding adds an attention bias (a heads x tokens^2 table at every size: its memory cost)."""
        return type(self).bias is not PosEmbed.bias

    @property
    def learned_bias(self) -> bool:
        """Whether the attention bias has trainable parameters: autograd then needs its gradient, which SDPA's fused CPU
        kernel does not give, so training attention holds every image's heads x tokens^2 probabilities (its memory)."""
        return self.biased and any(p.requires_grad for p in self.parameters())

    def train_floats_per_token(self) -> int:
        """Numbers per token and block this encoding keeps for the backward pass beyond the block's own activations (a
        training step's memory plan adds them; 0: none worth counting)."""
        return 0

    @property
    def bias_tables(self) -> int:
        """How many ``heads x tokens^2`` tables the attention bias holds (0: no bias; one per block where it differs by
        block): the memory plans count them."""
        return 1 if self.biased else 0

    def infer_floats_per_token(self) -> int:
        """Numbers per token of each image an inference holds in a block beyond its activations (features appended to
        q and k): the inference memory plans add them."""
        return 0

    def table_floats_per_token(self) -> int:
        """Numbers per token the cached context holds for a grid, shared by the batch (per-token rotation matrices):
        the memory plans add them."""
        return 0

    def rope_mix(self) -> Optional[Tensor]:
        return None

    def rope_magnitude(self, grid: PatchGrid) -> Optional[Tensor]:
        return None

    def condition_layers(self) -> FrozenSet[int]:
        return frozenset()

    def condition(self, layer: int, x: Tensor, grid: PatchGrid) -> Tensor:
        return x

    def qk_features(self, layer: int, x: Tensor, grid: PatchGrid) -> Optional[Tuple[Tensor, Tensor]]:
        """Features for the queries and keys of block ``layer``'s patch tokens, ``(B, heads, N, E)`` each, from the
        block's attention input ``x`` ``(B, N, dim)``: their product adds to the logits (``None``: no such term)."""
        return None

    def onnx_refusal(self) -> Optional[str]:
        """Why this encoding cannot go into an ONNX graph that takes any input size (``None``: it can; vitpe.export_onnx
        refuses with this line): an operator ONNX lacks, or a choice made per size outside the graph."""
        return self.size_choice()

    def size_choice(self) -> Optional[str]:
        """A choice this encoding makes per input size in Python, outside any traced graph (``None``: it has none, and a
        ``torch.jit.trace`` or ONNX graph computes it from each input's size); a trace is then pinned to its size."""
        return None

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """The entries of this PE's state dict that a timm model's PE weights give (``{}``: none; the PE then
        keeps its own). ``weights`` uses timm's names: ``pos_embed`` ``(1, h*w, D)`` (patch positions only),
        ``rope.freqs`` (RoPE-ViT), ``relative_position_bias_table`` (Swin), ``cpb_mlp.*`` (Swin-V2). A weight
        that is meant for this PE but does not fit it raises ``ValueError``. The PE decides, never a key name."""
        return {}

    def resampled_state(self, state: Dict[str, Tensor], from_grid: Size2) -> Dict[str, Tensor]:
        """This PE's state dict from ``state``, the state of the same family and options trained on the reference grid
        ``from_grid``: what a fine-tune at another size or patch size starts from. A family whose parameters are
        functions of coordinates (frequencies, MLPs, slopes) takes them as they are: the new grid's coordinates are its
        adaptation. A family with a table laid on the grid overrides this to resample it, so that on its new reference
        grid it gives what the trained table gave on that grid in interpolate mode."""
        return dict(state)

    def own_grid(self, grid: PatchGrid) -> PatchGrid:
        """``grid`` in this PE's own coordinate mode, if it has one."""
        return grid.in_mode(self.coord_mode)

    @staticmethod
    def _timm_weight(weights: Dict[str, Tensor], key: str, own: Tensor, what: str) -> Dict[str, Tensor]:
        """``{name: weights[key]}`` for the one-tensor case of :meth:`from_timm`; ``{}`` if absent, an error if misshapen."""
        value = weights.get(key)
        if value is None:
            return {}
        if value.shape != own.shape:
            raise ValueError(f"timm {key} {tuple(value.shape)} does not fit {what} {tuple(own.shape)}")
        return {what.rpartition(".")[2]: value}

    # ---- caching ---------------------------------------------------------------------------------
    def _cached(self, key: Optional[Hashable], fn: Callable[[], object]) -> object:
        """``fn()``, remembered under ``key`` (least recently used evicted); ``key=None`` computes afresh. Under
        ``torch.compile`` and ``torch.jit.trace`` always afresh: the graph computes the tables itself (they are small next
        to a block), and a compiled graph cannot see the parameter versions the cache keys on (a trace that took a cached
        table would differ from the trace of a first call, and torch.jit.trace's check refuses that)."""
        if key is None or torch.compiler.is_compiling() or torch.jit.is_tracing():
            return fn()
        if key in self._memo_store:
            self._memo_store.move_to_end(key)
            return self._memo_store[key]
        value = self._memo_store[key] = fn()
        while len(self._memo_store) > _CACHE_ENTRIES:
            self._memo_store.popitem(last=False)
        return value

    def memo(self, grid: PatchGrid, tag: str, fn: Callable[[], object]) -> object:
        """Cache ``fn()`` for canonical grids. Use it only for values that do not need gradients."""
        return self._cached(None if grid.key is None else (tag, grid.key), fn)

    def _param_state(self) -> Optional[tuple]:
        """Identity of the current parameter values, or None if the context must be rebuilt (training)."""
        if torch.compiler.is_compiling():
            return None
        params = list(self.parameters())
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return None  # tables built from trained parameters carry gradients: rebuild once per step
        # _version counts in-place updates (optimizer steps, load_state_dict), so a stale table is never reused.
        return tuple((p.data_ptr(), p._version) for p in params)

    def context(self, grid: PatchGrid, num_prefix: int = 0, dtype: torch.dtype = torch.float32) -> PosContext:
        """Everything the blocks need for ``grid``, cached per (grid, device, dtype, parameter values)."""
        state = self._param_state() if grid.key is not None else None
        key = None if state is None else ("context", grid.key, num_prefix, dtype, state)
        return self._cached(key, lambda: self._build_context(grid, num_prefix, dtype))

    def _build_context(self, grid: PatchGrid, num_prefix: int, dtype: torch.dtype) -> PosContext:
        own = self.own_grid(grid)
        tokens = self.tokens(own)
        bias = self.bias(own)
        angles = self.rope_angles(own)
        mats = self.rope_rotations(own)
        mix = self.rope_mix()
        magnitude = self.rope_magnitude(own)
        layers = self.condition_layers()
        extends = type(self).qk_features is not PosEmbed.qk_features
        ctx = PosContext(grid, num_prefix, conditionals=(self,) if layers else (), condition_layers=layers,
                         extenders=(self,) if extends else ())
        if tokens is not None:
            ctx.tokens = tokens.to(dtype)
        if bias is not None:
            ctx.mask_per_layer = bias.dim() == 4 + grid.batched  # (L, [B], heads, N, N)
            ctx.bias = F.pad(bias, (num_prefix, 0, num_prefix, 0)).to(dtype)  # prefix rows/cols: 0
        ctx.mask = _attention_mask(ctx.bias, grid, num_prefix)
        if mix is not None:
            ctx.mix = mix.to(dtype)
        if magnitude is not None:  # (.., N): prefix tokens take their row's first patch token's factor
            magnitude = torch.cat([magnitude[..., :1].expand(*magnitude.shape[:-1], num_prefix), magnitude], -1)
        if mats is not None:
            mats = _layers_first(mats, grid.batched, extra=2)  # (L, [B], heads, N, K, b, b)
            eye = torch.eye(mats.shape[-1], device=mats.device, dtype=mats.dtype).expand(*mats.shape[:-4], num_prefix, *mats.shape[-3:])
            ctx.mats = torch.cat([eye, mats], -4).to(dtype)  # prefix tokens: the identity
            if magnitude is not None:
                ctx.mats = ctx.mats * _per_token(magnitude, grid.batched, extra=3).to(dtype)
            if not grid.batched:  # one rotation per token for the whole batch: dense products are faster
                ctx.mats = blocks_to_dense(ctx.mats)
        if angles is not None:
            angles = _layers_first(angles, grid.batched)
            angles = F.pad(angles, (0, 0, num_prefix, 0))  # prefix tokens: angle 0, the identity
            ctx.cos, ctx.sin = angles.cos().to(dtype), angles.sin().to(dtype)
            if magnitude is not None:
                m = _per_token(magnitude, grid.batched, extra=1).to(dtype)
                ctx.cos, ctx.sin = ctx.cos * m, ctx.sin * m
            if dtype in (torch.float32, torch.float64) and not torch.onnx.is_in_onnx_export():  # ONNX has no complex numbers
                ctx.rot = torch.complex(ctx.cos, ctx.sin)
        return ctx

    def clear_cache(self) -> None:
        self._memo_store.clear()

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(): cached tables belong to the old device/dtype
        self.clear_cache()
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        mode = "" if self.coord_mode is None else f", coord_mode={self.coord_mode}"
        return f"dim={self.dim}, num_heads={self.num_heads}, ref_grid={self.ref_grid}{mode}"
