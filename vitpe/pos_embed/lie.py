"""Rotary encodings as matrix exponentials of learned skew-symmetric generators: LieRE and ComRoPE.

Both rotate q and k by ``R(p) = exp(x A_x + y A_y)``, block-diagonal with ``b x b`` blocks. LieRE learns any
generators (more expressive; the rotation then depends on more than the offset), ComRoPE learns generators that
commute, which keeps RoPE's relative property. Their frequencies are eigenvalues of learned matrices, not a table,
so of the extrapolation controls they take position interpolation (``scaling="pi"``, or interpolate-mode
coordinates); NTK, YaRN and p-RoPE act on explicit frequencies and raise here.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ..coords import PatchGrid, Size2
from .base import PEOption, PosEmbed
from .functional import generator_rotations, skew
from .registry import register_pos_embed
from .rotary import length_ratio

__all__ = ["MatrixRotary", "LieRE", "ComRoPE"]


# ---- the maths of this file's families (pure functions; maths that families share: functional.py) ----

def commuting_lattice_rotations(xs: Tensor, ys: Tensor, gens: Tensor) -> Tensor:
    """:func:`generator_rotations` on a lattice ``(x_j, y_i)`` (row-major) when ``A_x`` and ``A_y`` commute (ComRoPE):
    ``exp(x A_x + y A_y) = exp(x A_x) exp(y A_y)``, so ``w + h`` matrix exponentials serve all ``h w`` tokens.
    ``xs`` ``(w,)``, ``ys`` ``(h,)``, ``gens`` ``(2, *F, K, b, b)`` -> ``(*F, h*w, K, b, b)``."""
    n_f = gens.dim() - 4
    ex = torch.linalg.matrix_exp(xs.reshape(-1, *([1] * (n_f + 3))) * gens[0])  # (w, *F, K, b, b)
    ey = torch.linalg.matrix_exp(ys.reshape(-1, *([1] * (n_f + 3))) * gens[1])  # (h, *F, K, b, b)
    rot = ex[None] @ ey[:, None]  # (h, w, *F, K, b, b)
    return rot.flatten(0, 1).movedim(0, -4)



def _row_axes(grid, coords: Tensor) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Per-image coordinates in which each image is a lattice of its own (scaled and shifted per image by
    ``coord_aug``, perhaps token-dropped or packed several to a row) take one ``x`` per grid column and one ``y`` per grid
    row of each image. Returns those values, ``xs`` ``(B, S*w)`` and ``ys`` ``(B, S*h)`` for ``S`` slots per row (a packed
    row's images and a spare one for padding), and each token's index into them, ``(B, N)`` twice, so that commuting
    generators take ``w + h`` exponentials per image instead of one per token. None for anything else (coordinates
    given directly, per-token affines). ``coords``: the grid's, perhaps rescaled per image (position interpolation).
    Reads no data: ``torch.compile`` traces it."""
    if not grid.batched or grid.cells is None or grid.canvas is None or grid.mode is None or not grid.affine_per_image:
        return None
    h, w = grid.canvas
    col, row = grid.cells[..., 0], grid.cells[..., 1]
    slots = 1 if grid.segments is None else grid.images_per_row + 1  # padding (segment -1): a spare slot no image reads
    if slots * (w + h) >= coords.shape[1]:  # no fewer exponentials than one per token
        return None
    if grid.segments is not None:
        slot = torch.where(grid.segments < 0, slots - 1, grid.segments)
        col, row = slot * w + col, slot * h + row
    xs = coords.new_zeros(coords.shape[0], slots * w).scatter(1, col, coords[..., 0])  # every token of a column: one x
    ys = coords.new_zeros(coords.shape[0], slots * h).scatter(1, row, coords[..., 1])
    return xs, ys, col, row


class MatrixRotary(PosEmbed):
    """Shared machinery: blocks of ``block_size`` over each head's dimensions, generators per head (and per layer by
    default), initialised ``N(0, init_std^2)`` before skew-symmetrisation. ``init_std=None`` takes ``1 / max(ref_grid)``:
    the ComRoPE code's ``N(0, 1)`` for positions in ``[0, 1]``, in vitpe's unit of one reference patch."""

    acts_on = "q and k"
    commuting: bool = False  # A_x A_y = A_y A_x, so exp(x A_x + y A_y) factors
    test_options = (PEOption("scaling", "scaling", str, "past the trained extent: none, or pi (position interpolation); "
                             "learned rotations have no frequency table for NTK, YaRN or p-RoPE", flag="--rope-scaling"),)
    cost_note = ("rotates by dense products of a learned matrix per token, head and layer (training about 0.85x of no PE); "
                 "those rotation tables hold depth x heads x tokens x head_dim x block_size numbers per grid")

    def onnx_refusal(self) -> Optional[str]:
        return "its rotations are matrix exponentials of the coordinates (torch.linalg.matrix_exp), which ONNX has no operator for"

    def train_floats_per_token(self) -> int:
        # each token's rotation blocks (heads x head_dim x block_size) and matrix_exp's saved intermediates: 1.5x measured
        return 3 * self.dim * self.block_size // 2

    def table_floats_per_token(self) -> int:
        # the rotation blocks of each layer (dim x block_size a token) while matrix_exp's working copies exist: about 12x
        # of them measured, 6x where the exponentials factor over a lattice's rows and columns
        layers = self.depth if self.per_layer else 1
        return (6 if self.commuting else 12) * layers * self.dim * self.block_size

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, block_size: int = 8,
                 init_std: Optional[float] = None, per_layer: bool = True, scaling: str = "none") -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if block_size < 2 or self.head_dim % block_size:
            raise ValueError(f"{self.name}: block_size={block_size} must be at least 2 and divide head_dim={self.head_dim}")
        self.block_size, self.per_layer = block_size, per_layer
        self.init_std = 1.0 / max(self.ref_grid) if init_std is None else float(init_std)
        self.num_blocks = self.head_dim // block_size
        self.scaling = scaling

    @property
    def scaling(self) -> str:
        return self._scaling

    @scaling.setter
    def scaling(self, method: str) -> None:
        if method not in ("none", "pi"):
            raise ValueError(f"{self.name} learns its rotations as matrix exponentials, with no frequency table for "
                             f"NTK, YaRN or p-RoPE to act on; scaling={method!r} is not available: use 'pi' or 'none'")
        self._scaling = method
        self.clear_cache()

    def _init(self, *shape: int) -> nn.Parameter:
        layers = self.depth if self.per_layer else 1
        return nn.Parameter(torch.randn(layers, self.num_heads, *shape, self.block_size, self.block_size) * self.init_std)

    def generators(self) -> Tensor:
        """``(2, L|1, heads, K, b, b)`` skew-symmetric generators ``(A_x, A_y)``."""
        raise NotImplementedError

    def rope_rotations(self, grid: PatchGrid) -> Tensor:
        gens = self.generators()
        coords = grid.coords.to(gens.device, gens.dtype)
        ratio = length_ratio(self, grid) if self.scaling == "pi" else None
        if ratio is not None:
            coords = coords / ratio.to(coords)  # position interpolation: back into the trained extent
        if self.commuting and grid.spacing is not None:  # a lattice: w + h exponentials instead of h w
            h, w = grid.size
            return commuting_lattice_rotations(coords[:w, 0], coords[::w, 1], gens)
        axes = _row_axes(grid, coords) if self.commuting else None
        if axes is not None:  # a lattice per image: w + h exponentials per image, exp(x A_x) exp(y A_y) per token
            xs, ys, col, row = axes
            pick = torch.arange(col.shape[0], device=col.device)[:, None]
            ex = generator_rotations(torch.stack([xs, torch.zeros_like(xs)], -1), gens).movedim(-4, 1)  # (B, S w, L, H, K, b, b)
            ey = generator_rotations(torch.stack([torch.zeros_like(ys), ys], -1), gens).movedim(-4, 1)
            return (ex[pick, col] @ ey[pick, row]).movedim(1, -4)  # (B, L, H, N, K, b, b)
        return generator_rotations(coords, gens)  # ([B], L, H, N, K, b, b)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", block_size={self.block_size}" + ("" if self.scaling == "none" else f", scaling={self.scaling}")


@register_pos_embed("liere")
class LieRE(MatrixRotary):
    """LieRE (Ostmeier et al., "LieRE: Lie Rotational Positional Encodings", ICML 2025): ``R(p) = exp(x A_x + y A_y)``
    with learned skew-symmetric ``A_x, A_y`` per head, blockwise (``block_size``; the paper's full form is
    ``block_size=head_dim``). Rotations are orthogonal, but for ``b > 2`` the generators need not commute, so
    ``q . k`` depends on both positions, not only their offset; ``block_size=2`` (2x2 generators always commute) keeps
    the relative property and is RoPE-Mixed with learned frequencies."""

    per_image_cost = ("takes a matrix exponential per image and token, per layer and head: training with coord_aug drawn "
                      "per image runs about 35x slower")

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, **options) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **options)
        self.weight = self._init(2, self.num_blocks)  # (L, H, 2, K, b, b)

    def generators(self) -> Tensor:
        return skew(self.weight).movedim(2, 0)  # (2, L, H, K, b, b)


@register_pos_embed("comrope")
class ComRoPE(MatrixRotary):
    """ComRoPE (Yu et al., "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable
    Commuting Angle Matrices", CVPR 2025): generators that commute, so ``R(p)^T R(p') = R(p' - p)`` and ``q . k``
    depends only on the offset, with trainable ``b x b`` angle matrices. ``variant="ld"`` (linearly dependent): per
    block one skew matrix ``A``, scaled per axis, ``A_x = m_x A``, ``A_y = m_y A``. ``variant="ap"`` (axis
    partition): each block belongs to one axis (blocks alternate x, y) and turns with it alone."""

    commuting = True
    per_image_cost = ("takes matrix exponentials per image row and column, per layer and head: training with coord_aug drawn "
                      "per image runs about 9x slower")

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, variant: str = "ld", **options) -> None:
        super().__init__(dim, num_heads, ref_grid, depth, **options)
        if variant not in ("ld", "ap"):
            raise ValueError(f"comrope variant must be 'ld' (linearly dependent) or 'ap' (axis partition), got {variant!r}")
        self.variant = variant
        self.weight = self._init(self.num_blocks)  # (L, H, K, b, b)
        if variant == "ld":
            self.multiplier = nn.Parameter(torch.randn(2, self.weight.shape[0], 1, self.num_blocks))  # (2, L, 1, K)
        else:
            self.register_buffer("axis", (torch.arange(self.num_blocks) % 2 == torch.arange(2)[:, None]).float(), persistent=False)  # (2, K)

    def generators(self) -> Tensor:
        a = skew(self.weight)[None]  # (1, L, H, K, b, b)
        scale = self.multiplier if self.variant == "ld" else self.axis[:, None, None]  # (2, L|1, 1, K)
        return a * scale[..., None, None]
