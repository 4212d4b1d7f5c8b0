"""Relative encodings added to the attention logits: Swin's bias table, Swin-V2's continuous bias, FIRE, LookHere, 2D
ALiBi."""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..coords import PatchGrid, Size2, cell_coords, patch_units
from .base import PEOption, PosEmbed
from .functional import lattice_offsets, relative_offsets, relative_position_index, sample_bias_table
from .registry import register_pos_embed, set_pe_option

__all__ = ["RelativePositionBias", "ContinuousPositionBias", "FIRE", "LookHere", "ALiBi2d"]


# ---- the maths of this file's families (pure functions; maths that families share: functional.py) ----

def log_spaced(offsets: Tensor, ref: Tuple[int, int]) -> Tensor:
    """Swin-V2's log-spaced coordinates (Liu et al. 2022): offsets normalised by ``ref - 1`` to [-1, 1],
    scaled by 8, then ``sign(d) * log2(1 + |d|) / log2(8)``. Columns stay ``(dx, dy)``."""
    norm = torch.tensor([max(ref[1] - 1, 1), max(ref[0] - 1, 1)], device=offsets.device, dtype=offsets.dtype)
    d = offsets / norm * 8
    return torch.sign(d) * torch.log2(d.abs() + 1.0) / math.log2(8)


def fire_features(offsets: Tensor, extent: Tensor, c: Tensor) -> Tensor:
    """FIRE's input (Li et al., ICLR 2024), in 2D: ``psi(d) / psi(extent)`` per axis with ``psi(d) = sign(d) log(c|d| + 1)``.
    ``offsets`` ``(..., 2)``, ``extent`` (the normaliser, the image's extent per axis, broadcasting) -> ``(..., 2)`` in
    ``[-1, 1]`` for offsets inside the image: a larger image gives a denser, not a wider, range. ``c > 0``."""
    return torch.sign(offsets) * torch.log1p(c * offsets.abs()) / torch.log1p(c * extent)


LOOKHERE_DIRECTIONS = ((0.0, -1.0), (0.0, 1.0), (-1.0, 0.0), (1.0, 0.0))  # up, down, left, right (rows grow downwards)


def lookhere_directions(num_heads: int, fov: float) -> Tensor:
    """LookHere's head directions (Fuller et al., NeurIPS 2024): ``(heads, 2)`` unit ``(x, y)``. Heads cycle through up,
    down, left, right; a field of view under 90 degrees needs the diagonals too, so eight directions are cycled."""
    if fov >= 90:
        table = torch.tensor(LOOKHERE_DIRECTIONS)
    else:
        a = torch.arange(8) * (math.pi / 4) - math.pi / 2
        table = torch.stack([a.cos(), a.sin()], -1)
    return table[torch.arange(num_heads) % len(table)]


def lookhere_bias(offsets: Tensor, directions: Tensor, fov: float, slopes: Tensor) -> Tensor:
    """LookHere (Fuller et al., NeurIPS 2024): offsets query minus key ``(..., 2)`` (:func:`relative_offsets`), head
    directions ``(H, 2)``, slopes ``(*L, H)`` -> ``(*L, ..., H)``: minus ``slope * distance`` where the key lies in the
    head's field of view (``fov`` degrees about its direction, the query itself included), ``-inf`` outside. The
    directional masks make heads look different ways; at new resolutions no head meets a direction it never saw."""
    to_key = -offsets  # from the query to the key
    dist = to_key.norm(dim=-1, keepdim=True)  # (..., 1)
    inside = to_key @ directions.t().to(to_key) >= dist * math.cos(math.radians(fov) / 2) - 1e-6  # (..., H)
    lead = slopes.shape[:-1]
    penalty = dist * slopes.reshape(*lead, *([1] * (dist.dim() - 1)), -1).to(dist)  # (*L, ..., H)
    return (-penalty).masked_fill(~inside, float("-inf"))


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al., ICLR 2022): for ``n`` a power of two, the geometric sequence ``2^(-8 k / n)``,
    ``k = 1..n``; otherwise those of the nearest power of two below, then every other slope of the next one up."""
    def powers(n: int) -> List[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    if num_heads < 1:
        raise ValueError(f"alibi needs at least one head, got {num_heads}")
    low = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(low) + powers(2 * low)[0::2][: num_heads - low]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi2d_bias(offsets: Tensor, slopes: Tensor) -> Tensor:
    """2D ALiBi (CROMA, Fuller et al., NeurIPS 2023): ``-slope_h * |d|``, the Euclidean length of each offset ``d``
    ``(..., 2)`` in reference patches, per head: ``(..., H)``."""
    return -offsets.norm(dim=-1, keepdim=True) * slopes.to(offsets)



def _per_slot(grid, values: Tensor) -> Tensor:
    """Per-token ``values`` ``(B, N, C)`` as one row per image: ``(B, K, C)``, ``K`` images per row (slot order; 1 unless
    packed). Every token of an image carries the same value (its image's size or augmentation), so any one will do.
    A row with fewer than ``K`` images gets ones in its empty slots: values no token reads, but finite, since a NaN
    there would still reach the gradients (``0 * NaN``) of the function evaluated at them."""
    if grid.segments is None:
        return values[:, :1]
    k = grid.images_per_row
    slot = torch.where(grid.segments < 0, k, grid.segments)  # padding: a spare slot, dropped below
    table = values.new_ones(values.shape[0], k + 1, values.shape[-1])
    return table.scatter(1, slot[..., None].expand_as(values), values)[:, :k]


def _row_lattices(grid) -> Tuple[Tensor, Tensor] | None:
    """Per-image coordinates in which every image is a lattice of its own grid, scaled and shifted per image
    (``coord_aug``), perhaps token-dropped, perhaps packed with others into one row (NaViT), have few distinct offsets:
    an image of at most ``(h, w)`` patches (the row's canvas) has at most ``(2h-1)(2w-1)``. Returns those offsets for
    each of the ``K`` images of each row, ``(B, K (2h-1)(2w-1), 2)``, and the index ``(B, N, N)`` that spreads them
    (a query's own image's block; pairs across images index anything, as the packing mask drops them), so that a bias
    function runs ``K (2h-1)(2w-1)`` times per row instead of at all ``N^2`` pairs (FIRE's MLP: 225 inputs per 8x8
    image, not 4,096). None for anything else: coordinates given directly, per-token affines
    (``TokenGrid.affine_per_image``), and packed rows where every pair is fewer. Nothing here reads data, so
    ``torch.compile`` traces it."""
    if not grid.batched or grid.cells is None or grid.canvas is None or grid.mode is None or not grid.affine_per_image:
        return None
    h, w = grid.canvas
    k = grid.images_per_row if grid.segments is not None else 1
    n = grid.coords.shape[1]
    if k * (2 * h - 1) * (2 * w - 1) >= n * n:
        return None
    dev = grid.coords.device
    per_token = torch.cat([grid.sizes.to(torch.float64), torch.ones_like(grid.coords[..., :2], dtype=torch.float64)
                           if grid.affine is None else grid.affine[..., :2].double()], -1)  # (B, N, 4): w, h, sx, sy
    per_image = _per_slot(grid, per_token)  # (B, K, 4)
    slot = torch.zeros_like(grid.cells[..., 0]) if grid.segments is None else grid.segments.clamp(min=0)
    sizes, scale = per_image[..., :2], per_image[..., 2:]
    unit = torch.tensor([[0, 0], [1, 1]], device=dev)  # the step of one cell, per axis, in this grid's mode
    step = cell_coords(unit, sizes[:, :, None], grid.ref, grid.mode, torch.float64).diff(dim=-2)  # (B, K, 1, 2)
    cells = lattice_offsets((h, w), (1.0, 1.0), dev).flatten(0, 1).double()  # (KK, 2) in cells
    offsets = (cells * step * scale[:, :, None]).flatten(1, 2).to(grid.coords.dtype)  # (B, K KK, 2)
    rel = grid.cells[:, :, None] - grid.cells[:, None, :]  # (B, N, N, 2) query minus key, in cells
    index = slot[:, :, None] * ((2 * h - 1) * (2 * w - 1)) + (rel[..., 1] + h - 1) * (2 * w - 1) + (rel[..., 0] + w - 1)
    return patch_units(offsets, grid, offsets=True), index


def _offsets_and_index(pe: PosEmbed, grid: PatchGrid) -> Tuple[Tensor, Tensor | None]:
    """Offsets (in reference patches) at which a bias function must be evaluated, and how to spread them over ``(N, N)``.

    On a uniform lattice there are only ``(2h-1)(2w-1)`` distinct offsets, gathered by Swin's index; so on per-image
    lattices (:func:`_row_lattices`), with one index per row. For irregular coordinates every pair is evaluated
    (``index`` is None): ``(..., N, N, 2)``.
    """
    spacing = grid.spacing
    if spacing is None and isinstance(grid, PatchGrid):  # an exported graph's grid: a lattice, its spacing computed there
        step = grid.step()
        spacing = None if step is None else tuple(step.to(grid.coords.device).unbind())
    if spacing is None:
        lattices = _row_lattices(grid)
        return lattices if lattices is not None else (patch_units(relative_offsets(grid.coords), grid, offsets=True), None)

    def build():
        offsets = patch_units(lattice_offsets(grid.size, spacing, grid.coords.device), grid, offsets=True)
        return offsets, relative_position_index(grid.size).to(grid.coords.device)

    return pe.memo(grid, "lattice", build)


def heads_first(values: Tensor) -> Tensor:
    """``(..., N, N, H)`` -> ``(..., H, N, N)``: ``movedim(-1, -3)`` as two transposes, which torch.onnx exports right."""
    return values.transpose(-1, -2).transpose(-2, -3)


def _spread(values: Tensor, index: Tensor | None) -> Tensor:
    """``values``: ``(2h-1, 2w-1, H)`` with an ``(N, N)`` index, ``(B, K, H)`` with a ``(B, N, N)`` one (one lattice per
    row), or ``(..., N, N, H)`` without; returns ``(..., H, N, N)``."""
    if index is not None and index.dim() == 3:
        values = values[torch.arange(index.shape[0], device=index.device)[:, None, None], index]  # (B, N, N, H)
    elif index is not None:
        values = values.flatten(0, 1)[index]  # (N, N, H)
    return heads_first(values)


@register_pos_embed("rel_bias")
class RelativePositionBias(PosEmbed):
    """Swin relative position bias (Liu et al., ICCV 2021): one learned bias per head and relative offset,
    a ``(2h-1)(2w-1) x heads`` table indexed exactly as Swin at the reference grid. At other grids the
    table is sampled (bicubically by default) at the continuous offsets, borders held beyond its range.
    """

    acts_on = "attention logits"

    def __init__(
        self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, interpolation: str = "bicubic", std: float = 0.02
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if interpolation not in ("bicubic", "bilinear", "nearest"):
            raise ValueError(f"rel_bias interpolation must be 'bicubic', 'bilinear' or 'nearest', got {interpolation!r}")
        h, w = self.ref_grid
        self.interpolation = interpolation
        self.table = nn.Parameter(torch.zeros((2 * h - 1) * (2 * w - 1), num_heads))  # ((2h-1)(2w-1), H)
        trunc_normal_(self.table, std=std)

    def bias(self, grid: PatchGrid) -> Tensor:
        if grid.is_reference:
            index = self.memo(grid, "index", lambda: relative_position_index(grid.size).to(self.table.device))
            return self.table[index].permute(2, 0, 1)  # exactly Swin's gather
        offsets, index = _offsets_and_index(self, grid)
        return _spread(sample_bias_table(self.table, offsets.to(self.table.device), self.ref_grid, self.interpolation), index)

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Swin's ``relative_position_bias_table``: vitpe indexes it exactly as Swin does."""
        return self._timm_weight(weights, "relative_position_bias_table", self.table, "rel_bias.table")

    def resampled_state(self, state: Dict[str, Tensor], from_grid: Size2) -> Dict[str, Tensor]:
        """The trained table (on ``from_grid``) sampled at this reference grid's offsets in interpolate mode, as Swin and
        BEiT resize theirs for a new window (an interpolation of the table)."""
        grid = PatchGrid.create(self.ref_grid, from_grid, "interpolate")
        offsets = lattice_offsets(self.ref_grid, grid.spacing, state["table"].device).flatten(0, 1)  # ((2h-1)(2w-1), 2)
        return {"table": sample_bias_table(state["table"], offsets, from_grid, self.interpolation).contiguous()}


@register_pos_embed("cpb")
class ContinuousPositionBias(PosEmbed):
    """Swin-V2 log-spaced continuous position bias (Liu et al., CVPR 2022): a small MLP of the log-spaced
    offset, ``16 * sigmoid(MLP(sign(d) log2(1 + |8d/(ref-1)|) / 3))``. Offsets are continuous, so a new
    grid just evaluates the MLP at new points; the log spacing keeps extrapolated offsets near the
    trained range.

    timm's relative-position ViTs (``vit_relpos_*``, its "cr" form) are the options ``spacing="log"`` (``sign(d) ln(1 + |d|)``
    of the offset in patches), ``squash=False`` (the MLP's output is the bias), ``out_bias=True`` (a bias on the MLP's
    last layer) and ``per_layer=True`` (one MLP per block)."""

    acts_on = "attention logits"
    cost_note = ("runs its MLP (hidden_dim wide) at every distinct offset; with coordinates per image at each image's own "
                 "offsets, which makes training with coord_aug drawn per image about 2x slower")
    SPACINGS = ("swin_v2", "log")

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, hidden_dim: int = 512, spacing: str = "swin_v2",
                 squash: bool = True, out_bias: bool = False, per_layer: bool = False) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if spacing not in self.SPACINGS:
            raise ValueError(f"cpb spacing must be one of {', '.join(self.SPACINGS)}, got {spacing!r}")
        self.spacing, self.squash, self.per_layer = spacing, squash, per_layer

        def mlp() -> nn.Sequential:
            return nn.Sequential(nn.Linear(2, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, num_heads, bias=out_bias))

        self.mlp = nn.ModuleList(mlp() for _ in range(depth)) if per_layer else mlp()

    def _features(self, offsets: Tensor) -> Tensor:
        if self.spacing == "log":
            return torch.sign(offsets) * torch.log1p(offsets.abs())
        return log_spaced(offsets, self.ref_grid)

    def bias(self, grid: PatchGrid) -> Tensor:
        offsets, index = _offsets_and_index(self, grid)
        mlps = list(self.mlp) if self.per_layer else [self.mlp]
        weight = mlps[0][0].weight
        table = self.memo(grid, ("features", self.spacing), lambda: self._features(offsets)) if index is not None else self._features(offsets)
        table = table.to(weight.device, weight.dtype)
        out = [_spread(m(table), index) for m in mlps]
        out = torch.stack(out) if self.per_layer else out[0]  # (L, [B], H, N, N) or ([B], H, N, N)
        return 16 * torch.sigmoid(out) if self.squash else out

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Swin-V2's ``cpb_mlp``, or timm's relative-position ViT MLPs (``blocks.{i}.attn.rel_pos.mlp.*`` per block,
        ``shared_rel_pos.mlp.*`` shared). Their input columns are ``(dy, dx)``, vitpe's ``(dx, dy)``: the first layer's
        columns are swapped, so the same MLP sees the same offsets."""
        if "cpb_mlp.0.weight" in weights:
            names = {"0.weight": "cpb_mlp.0.weight", "0.bias": "cpb_mlp.0.bias", "2.weight": "cpb_mlp.2.weight", "2.bias": "cpb_mlp.2.bias"}
            out = {f"mlp.{k}": weights[v] for k, v in names.items() if v in weights}
        elif any(".rel_pos.mlp." in k or k.startswith("shared_rel_pos.mlp.") for k in weights):
            shared = "shared_rel_pos.mlp.fc1.weight" in weights
            if shared == self.per_layer:
                raise ValueError(f"timm's {'shared' if shared else 'per-block'} relative-position MLP needs cpb per_layer={not shared}")
            sources = {"": "shared_rel_pos.mlp."} if shared else {f"{i}.": f"blocks.{i}.attn.rel_pos.mlp." for i in range(self.depth)}
            out = {}
            for ours, theirs in sources.items():
                for k, v in (("0.weight", "fc1.weight"), ("0.bias", "fc1.bias"), ("2.weight", "fc2.weight"), ("2.bias", "fc2.bias")):
                    if theirs + v in weights:
                        out[f"mlp.{ours}{k}"] = weights[theirs + v]
        else:
            return {}
        out = {k: v[:, [1, 0]] if k.endswith("0.weight") and v.shape[-1] == 2 else v for k, v in out.items()}
        own = dict(self.state_dict())
        bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape) if k in own else 'none'}" for k, v in out.items() if k not in own or v.shape != own[k].shape]
        missing = [k for k in own if k not in out]
        if bad or missing:
            raise ValueError(f"the timm position MLP does not fit this cpb (hidden_dim, num_heads, out_bias): {(bad or missing)[0]}")
        return out


def _pairwise(pe: PosEmbed, grid: PatchGrid) -> Tuple[Tensor, Tensor | None, Tensor]:
    """:func:`_offsets_and_index` plus the image extent (the normaliser) of each offset, in reference patches: ``(2,)``
    for a shared grid, ``(B, N, 1, 2)`` per query for every pair, ``(B, K (2h-1)(2w-1), 2)`` on per-image lattices."""
    offsets, index = _offsets_and_index(pe, grid)
    extent = patch_units(grid.extent(), grid, offsets=True)
    if not grid.batched:
        return offsets, index, extent
    if index is None:
        return offsets, index, extent[:, :, None]  # per query
    per_image = _per_slot(grid, extent)  # (B, K, 2): each image's lattice offsets take its own extent
    return offsets, index, per_image.repeat_interleave(offsets.shape[1] // per_image.shape[1], dim=1)


@register_pos_embed("fire")
class FIRE(PosEmbed):
    """FIRE, functional interpolation for relative positions (Li et al., ICLR 2024), in 2D as the ViT resolution
    studies use it: ``bias = MLP(psi(d) / psi(extent))`` per axis, ``psi(d) = sign(d) log(c |d| + 1)`` with ``c`` learned.
    The normaliser is the image's extent, so the MLP's input stays in ``[-1, 1]`` at any size: a larger image is a
    denser, not a wider, range of inputs, never an offset the MLP has not seen. One MLP for all blocks (as ``cpb``)."""

    acts_on = "attention logits"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, hidden_dim: int = 32, c: float = 0.1) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if c <= 0:
            raise ValueError(f"fire c must be positive, got {c}")
        self.log_c = nn.Parameter(torch.tensor(float(c)).log())  # c > 0 by construction
        self.mlp = nn.Sequential(nn.Linear(2, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, num_heads))

    def bias(self, grid: PatchGrid) -> Tensor:
        offsets, index, extent = _pairwise(self, grid)
        weight = self.mlp[0].weight
        feats = fire_features(offsets.to(weight), extent.to(weight), self.log_c.exp())
        return _spread(self.mlp(feats), index)


def positive_number(text: str) -> float:
    """A command line's text as a positive, finite number (LookHere's slope)."""
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError(f"must be a positive, finite number, got {text}")
    return value


@register_pos_embed("lookhere")
class LookHere(PosEmbed):
    """LookHere (Fuller et al., "LookHere: Vision Transformers with Directed Attention Generalize and Extrapolate",
    NeurIPS 2024): each head sees only a field of view of ``fov`` degrees (180: half-planes, 90: quadrant cones, 45:
    eighths) pointing up, down, left or right (and the diagonals under 90 degrees), and pays a distance penalty
    ``global_slope * layer_slope * head_slope * distance`` (reference patches). Head slopes halve every group of
    directions (``2^-1, 2^-2, ...``), layer slopes run linearly from ``layer_slopes[0]`` in the first block to
    ``layer_slopes[1]`` in the last. Fixed, nothing learned; interpolate-mode coordinates keep distances in the
    trained range at any size."""

    acts_on = "attention logits"
    test_options = (PEOption("slope", "global_slope", positive_number, "the factor of every distance penalty (as trained: 1); slope k at k "
                             "times the training grid in interpolate mode gives extrapolate mode's penalties",
                             flag="--lookhere-slope"),)

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, fov: float = 180.0,
                 global_slope: float = 1.0, layer_slopes: Tuple[float, float] = (1.5, 0.5)) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if not 0 < fov <= 360:
            raise ValueError(f"lookhere fov must be in (0, 360] degrees, got {fov}")
        if len(layer_slopes) != 2:
            raise ValueError(f"lookhere layer_slopes must be (first block, last block), got {layer_slopes!r}")
        self.fov, self.layer_slopes = float(fov), tuple(float(s) for s in layer_slopes)
        self.register_buffer("directions", lookhere_directions(num_heads, fov), persistent=False)  # (H, 2)
        self.register_buffer("slopes", torch.empty(depth, num_heads), persistent=False)  # (L, H)
        self.global_slope = global_slope

    @property
    def global_slope(self) -> float:
        """The factor of every distance penalty. It is not a parameter, so it can be changed on a trained model
        (the authors' ``set_pos_embed(..., global_slope=)``): at a larger grid in extrapolate mode the same slope is a
        steeper penalty per image distance. Setting it rebuilds the slopes and drops this encoding's cached biases;
        :func:`set_lookhere_slope` (``vitpe.set_pe_option(model, "lookhere.slope", k)``) also drops those a combination or
        the model holds."""
        return self._global_slope

    @global_slope.setter
    def global_slope(self, value: float) -> None:
        # inf * 0 (a patch at distance zero from itself) is NaN: an infinite slope would poison every logit.
        if not 0 < value < math.inf:
            raise ValueError(f"lookhere global_slope must be positive and finite, got {value}")
        self._global_slope = float(value)
        groups = torch.arange(self.num_heads) // (4 if self.fov >= 90 else 8)
        layers = torch.linspace(*self.layer_slopes, self.depth)[:, None]
        self.slopes.copy_(self._global_slope * layers * 2.0 ** -(1 + groups.float()))
        self.clear_cache()

    @property
    def bias_tables(self) -> int:
        return self.depth  # a slope per block

    def bias(self, grid: PatchGrid) -> Tensor:
        def build():
            offsets, index = _offsets_and_index(self, grid)
            values = lookhere_bias(offsets.to(self.slopes), self.directions, self.fov, self.slopes)  # (L, ..., H)
            if index is not None and index.dim() == 3:  # one lattice per row: values (L, B, K, H)
                values = values[:, torch.arange(index.shape[0], device=index.device)[:, None, None], index]  # (L, B, N, N, H)
            elif index is not None:
                values = values.flatten(1, 2)[:, index]  # (L, N, N, H)
            return heads_first(values)  # (L, [B], H, N, N)

        # Not memoised: the context caches this table padded for the prefix tokens, and a second copy of depth x heads x
        # tokens^2 floats was the largest thing an evaluation at a large size held.
        return build()


@register_pos_embed("alibi2d")
class ALiBi2d(PosEmbed):
    """2D ALiBi (CROMA, Fuller et al., NeurIPS 2023; ALiBi, Press et al., ICLR 2022): a penalty linear in the Euclidean
    distance between two patches, ``-slope_h * |p_q - p_k|`` in reference patches, with ALiBi's geometric head slopes.
    Fixed, nothing learned, the same at every size: in interpolate mode distances stay in the trained range, in
    extrapolate mode a larger image reaches farther, penalised as the line continues (the additive bias the ViT
    extrapolation studies found to degrade most gently). ``slope_scale`` multiplies every slope, at build time or on a
    trained model (``eval.py --pe-option alibi2d.slope_scale=K``)."""

    acts_on = "attention logits"
    test_options = (PEOption("slope_scale", "slope_scale", positive_number, "the factor of every head's slope (as trained: 1)"),)

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, slope_scale: float = 1.0) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        self.register_buffer("base_slopes", alibi_slopes(num_heads), persistent=False)  # (H,)
        self.slope_scale = slope_scale

    @property
    def slope_scale(self) -> float:
        return self._slope_scale

    @slope_scale.setter
    def slope_scale(self, value: float) -> None:
        if not 0 < value < math.inf:
            raise ValueError(f"alibi2d slope_scale must be positive and finite, got {value}")
        self._slope_scale = float(value)
        self.clear_cache()

    def bias(self, grid: PatchGrid) -> Tensor:
        def build():
            offsets, index = _offsets_and_index(self, grid)
            return _spread(alibi2d_bias(offsets, self.base_slopes * self._slope_scale), index)

        return build()  # not memoised: the context keeps it (padded), one heads x tokens^2 table is enough


def set_lookhere_slope(module: nn.Module, global_slope: float) -> List[str]:
    """Set the global slope of every LookHere encoding in ``module`` (a model, a PE): the factor of each head's distance
    penalty, fixed, so a trained model can be evaluated with another (``eval.py --pe-option lookhere.slope=K``, or
    ``--lookhere-slope K``). In interpolate mode, slope ``k`` at ``k`` times the training grid gives exactly the
    penalties of extrapolate mode at slope 1. Returns the names of the encodings changed; a module without LookHere
    raises ``ValueError``."""
    return set_pe_option(module, "lookhere.slope", global_slope)
