"""Continuous patch-centre coordinates: the one input every positional encoding is a function of.

A new resolution is only a new set of coordinates. Coordinates are in units of *reference-grid
patches* (the grid the model was built for), columns ``(x, y)``, tokens in row-major order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["COORD_MODES", "grid_coords", "PatchGrid", "CoordAugment", "to_2tuple", "snap"]

COORD_MODES = ("interpolate", "extrapolate")
CoordMode = Literal["interpolate", "extrapolate"]
Size2 = Union[int, Sequence[int]]


def to_2tuple(size: Size2, what: str = "size") -> Tuple[int, int]:
    """``8 -> (8, 8)``; ``(h, w) -> (h, w)``; anything else is a ``ValueError``."""
    if isinstance(size, int) and not isinstance(size, bool):
        out = (size, size)
    elif isinstance(size, (tuple, list, torch.Size)) and len(size) == 2:
        out = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{what} must be an int or a pair (h, w), got {size!r}")
    if min(out) < 1:
        raise ValueError(f"{what} must be positive, got {out}")
    return out


def snap(size: float, multiple: int) -> int:
    """The multiple of ``multiple`` nearest to ``size``, at least ``multiple``: the one rounding rule for input
    sizes (suggested fixes, default evaluation sizes, study resolutions)."""
    return max(multiple, int(round(size / multiple)) * multiple)


def _axis(n: int, ref: int, mode: str) -> Tuple[float, float]:
    """(scale, offset) such that patch ``j`` of an ``n``-patch axis sits at ``scale * j + offset``."""
    if mode == "interpolate":
        # The n patches cover the same extent as the ref patches: centre j maps to (j + .5) * ref / n - .5,
        # the half-pixel convention of F.interpolate(align_corners=False).
        scale = ref / n
        return scale, 0.5 * scale - 0.5
    if mode == "extrapolate":
        return 1.0, 0.0
    raise ValueError(f"unknown coord mode {mode!r}; expected one of {COORD_MODES}")


def grid_coords(
    grid_size: Size2,
    ref_grid: Optional[Size2] = None,
    mode: CoordMode = "interpolate",
    *,
    device: Optional[torch.device] = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Patch-centre coordinates of an ``(h, w)`` token grid: a ``(h*w, 2)`` tensor of ``(x, y)``.

    ``mode="interpolate"``: ``x_j = (j + 0.5) * ref_w / w - 0.5`` -- the new grid spans the reference
    grid's extent, more (or less) densely. ``mode="extrapolate"``: ``x_j = j`` -- positions beyond the
    trained range (as RoPE-ViT, Heo et al. 2024, evaluates). Both give the integer grid at the reference
    size. ``ref_grid=None`` means the grid is its own reference.
    """
    h, w = to_2tuple(grid_size, "grid_size")
    rh, rw = (h, w) if ref_grid is None else to_2tuple(ref_grid, "ref_grid")
    sx, ox = _axis(w, rw, mode)
    sy, oy = _axis(h, rh, mode)
    xs = torch.arange(w, device=device, dtype=torch.float64) * sx + ox
    ys = torch.arange(h, device=device, dtype=torch.float64) * sy + oy
    y, x = torch.meshgrid(ys, xs, indexing="ij")  # (h, w) each, row-major
    return torch.stack([x.flatten(), y.flatten()], dim=-1).to(dtype)


@dataclass(frozen=True, eq=False)
class PatchGrid:
    """The token grid one forward pass sees, handed to every positional encoding.

    ``coords`` is ``(h*w, 2)`` float32 ``(x, y)``. ``spacing`` is ``(sx, sy)`` when the coordinates form
    a uniform lattice (then relative offsets take only ``(2h-1)(2w-1)`` values, which the bias encodings
    exploit), else ``None``. ``key`` identifies canonical coordinates so that tables derived from them can
    be cached; ``None`` (e.g. augmented coordinates) disables caching. ``mode`` is the coordinate mode the
    grid was made in and ``affine`` the augmentation applied to it, ``(sx, sy, tx, ty)``: scale about the
    grid centre, then shift. Together they let :meth:`in_mode` give the same grid in another mode (each
    part of a combined PE may use its own); ``mode=None`` marks arbitrary coordinates.
    """

    size: Tuple[int, int]
    ref: Tuple[int, int]
    coords: Tensor
    spacing: Optional[Tuple[float, float]] = None
    key: Optional[tuple] = None
    mode: Optional[str] = None
    affine: Optional[Tuple[float, float, float, float]] = None

    @classmethod
    def create(
        cls,
        grid_size: Size2,
        ref_grid: Optional[Size2] = None,
        mode: CoordMode = "interpolate",
        device: Optional[torch.device] = None,
    ) -> "PatchGrid":
        size = to_2tuple(grid_size, "grid_size")
        ref = size if ref_grid is None else to_2tuple(ref_grid, "ref_grid")
        coords = grid_coords(size, ref, mode, device=device)
        spacing = (_axis(size[1], ref[1], mode)[0], _axis(size[0], ref[0], mode)[0])
        key = (size, ref, mode, coords.device)
        return cls(size, ref, coords, spacing, key, mode)

    @classmethod
    def from_coords(cls, coords: Tensor, grid_size: Size2, ref_grid: Size2) -> "PatchGrid":
        """Arbitrary coordinates (augmented, jittered, ...): no lattice shortcut, no caching."""
        size, ref = to_2tuple(grid_size, "grid_size"), to_2tuple(ref_grid, "ref_grid")
        if coords.shape != (size[0] * size[1], 2):
            raise ValueError(f"coords must have shape ({size[0] * size[1]}, 2) for grid {size}, got {tuple(coords.shape)}")
        return cls(size, ref, coords.float(), None, None)

    @property
    def is_reference(self) -> bool:
        """True when the coordinates are exactly the reference grid's integer lattice."""
        return self.key is not None and self.size == self.ref and self.spacing == (1.0, 1.0)

    def transformed(self, sx: float, sy: float, tx: float, ty: float) -> "PatchGrid":
        """Scale by ``(sx, sy)`` about the grid centre, then shift by ``(tx, ty)``: still a lattice, not cached."""
        c = self.coords
        centre = c.mean(0)
        factor = torch.tensor([sx, sy], device=c.device, dtype=c.dtype)
        coords = (c - centre) * factor + centre + torch.tensor([tx, ty], device=c.device, dtype=c.dtype)
        spacing = None if self.spacing is None else (self.spacing[0] * sx, self.spacing[1] * sy)
        if self.affine is not None:  # compose with an earlier augmentation
            psx, psy, ptx, pty = self.affine
            sx, sy, tx, ty = psx * sx, psy * sy, ptx + tx, pty + ty  # scaling about the centre keeps earlier shifts
        return PatchGrid(self.size, self.ref, coords, spacing, None, self.mode, (sx, sy, tx, ty))

    def in_mode(self, mode: Optional[str]) -> "PatchGrid":
        """The same grid with its coordinates in coordinate mode ``mode`` (``None``: unchanged), augmentation kept."""
        if mode is None or mode == self.mode:
            return self
        if self.mode is None:
            raise ValueError(
                f"a positional encoding with its own coord_mode={mode!r} needs a grid made by PatchGrid.create "
                "(these coordinates were given directly); drop the part's coord_mode or build the grid with a mode"
            )
        grid = PatchGrid.create(self.size, self.ref, mode, device=self.coords.device)
        return grid if self.affine is None else grid.transformed(*self.affine)


@dataclass(frozen=True)
class CoordAugment:
    """Random shift, rescale and aspect jitter of the patch coordinates while training, as DINOv3
    (Simeoni et al. 2025) does for RoPE: the model learns that positions are relative and scale-free,
    which helps at unseen resolutions. Off by default (all identities).

    ``shift``: offset drawn uniformly in ``[-shift, shift]`` reference patches per axis.
    ``rescale``: one factor drawn log-uniformly in ``[1/rescale, rescale]``, about the grid centre.
    ``jitter``: a further per-axis factor drawn log-uniformly in ``[1/jitter, jitter]``.
    One draw per batch (the PE tables are shared by the batch), from torch's global generator.
    """

    shift: float = 0.0
    rescale: float = 1.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if self.shift < 0 or self.rescale < 1 or self.jitter < 1:
            raise ValueError(f"coord_aug needs shift >= 0, rescale >= 1 and jitter >= 1, got {self}")

    @property
    def active(self) -> bool:
        return self.shift > 0 or self.rescale > 1 or self.jitter > 1

    def __call__(self, grid: PatchGrid) -> PatchGrid:
        u = torch.rand(5, dtype=torch.float64)
        scale = math.exp((2 * u[0].item() - 1) * math.log(self.rescale))
        sx = scale * math.exp((2 * u[1].item() - 1) * math.log(self.jitter))
        sy = scale * math.exp((2 * u[2].item() - 1) * math.log(self.jitter))
        tx, ty = ((2 * u[3:5] - 1) * self.shift).tolist()
        return grid.transformed(sx, sy, tx, ty)  # affine per axis: still a lattice
