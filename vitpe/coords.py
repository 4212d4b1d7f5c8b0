"""Continuous patch-centre coordinates: the one input every positional encoding is a function of.

A new resolution is only a new set of coordinates. Coordinates are in units of *reference-grid
patches* (the grid the model was built for), columns ``(x, y)``, tokens in row-major order.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass
from enum import Enum
from typing import ClassVar, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .suggest import did_you_mean

__all__ = ["COORD_MODES", "CoordMode", "grid_coords", "grid_cells", "cell_coords", "random_keep", "content_tokens", "PatchGrid", "TokenGrid", "CoordAugment",
           "to_2tuple", "snap", "patch_units", "reference_extent"]

class CoordMode(str, Enum):
    """How a grid of another size than the reference is given coordinates: the one type of a coordinate mode, each
    mode's meaning here and its formula in :func:`cell_coords`. A member is its name as a string (``"interpolate"``), so
    configs, tables and comparisons use plain text; :meth:`parse` is the one check of a name.

    - ``interpolate``: the grid spans the reference grid's extent, more (or less) densely: position interpolation,
      every coordinate inside the trained range.
    - ``extrapolate``: the integer grid continued: a larger image reaches positions beyond the trained range (RoPE-ViT's
      evaluation).
    - ``normalize``: patch centres in the fixed box ``[-1, 1]`` whatever the size (DINOv3's, NaViT's and CAPE's frame).
    - ``extend``: per axis, extrapolate where the grid has more patches than the reference and interpolate where it has
      fewer, so no axis spans less than the trained extent.
    """

    INTERPOLATE = "interpolate"
    EXTRAPOLATE = "extrapolate"
    NORMALIZE = "normalize"
    EXTEND = "extend"

    __str__ = str.__str__  # "interpolate", as configs and tables write it
    __format__ = str.__format__
    __hash__ = str.__hash__  # a member and its name are one dictionary key (Enum would hash the member's NAME)

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, mode: object, what: str = "coord_mode") -> "CoordMode":
        """``mode`` as a :class:`CoordMode`; anything else is a one-line ``ValueError`` naming the modes."""
        if isinstance(mode, cls):
            return mode
        try:
            return cls(mode)
        except ValueError:
            raise ValueError(f"{what}={mode!r} is not a coordinate mode{did_you_mean(mode, COORD_MODES)}; choose one of "
                             f"{', '.join(COORD_MODES)}") from None


COORD_MODES = tuple(m.value for m in CoordMode)  # their names, for command-line choices and messages
Size2 = Union[int, Sequence[int]]


def to_2tuple(size: Size2, what: str = "size") -> Tuple[int, int]:
    """``8 -> (8, 8)``; ``(h, w) -> (h, w)``; anything else is a ``ValueError``."""
    if isinstance(size, int) and not isinstance(size, bool):
        out = (size, size)
    elif isinstance(size, (tuple, list, torch.Size)) and len(size) == 2 and traced(size):
        return tuple(size)  # an exported graph's sizes (torch.onnx) stay in the graph: int() would freeze them
    elif isinstance(size, (tuple, list, torch.Size)) and len(size) == 2:
        out = (int(size[0]), int(size[1]))
    else:
        raise ValueError(f"{what} must be an int or a pair (h, w), got {size!r}")
    if min(out) < 1:
        raise ValueError(f"{what} must be positive, got {out}")
    return out


def traced(values: Sequence[object]) -> bool:
    """True while torch.onnx traces a model and ``values`` are sizes read from its input (0-dim tensors there)."""
    return torch.jit.is_tracing() and any(isinstance(v, Tensor) for v in values)


def pair(a: Union[int, float, Tensor], b: Union[int, float, Tensor], device: Optional[torch.device] = None,
         dtype: Optional[torch.dtype] = None) -> Tensor:
    """``(2,)`` tensor ``[a, b]`` of two numbers, or of two traced sizes, which then stay in an exported graph."""
    if traced((a, b)):
        return torch.stack([torch.as_tensor(v, device=device) for v in (a, b)]).to(dtype or torch.int64)
    return torch.tensor([a, b], device=device, dtype=dtype)


def snap(size: float, multiple: int) -> int:
    """The multiple of ``multiple`` nearest to ``size``, at least ``multiple``: the one rounding rule for input
    sizes (suggested fixes, default evaluation sizes, study resolutions)."""
    return max(multiple, int(round(size / multiple)) * multiple)


def _spacing(n: int, ref: int, mode: str) -> float:
    """Distance between neighbouring patch centres of an ``n``-patch axis, in reference patches (see :func:`cell_coords`)."""
    mode = CoordMode.parse(mode)
    if mode == "extend":
        mode = "extrapolate" if n > ref else "interpolate"
    return ref / n if mode == "interpolate" else 2.0 / n if mode == "normalize" else 1.0


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
    size. ``mode="normalize"``: ``x_j = 2 (j + 0.5) / w - 1`` -- patch centres in the fixed box ``[-1, 1]``
    whatever the size (DINOv3, Simeoni et al. 2025, "separate" normalisation; NaViT's and CAPE's frame), so a
    larger image is a denser grid in the same range. ``mode="extend"``: per axis, extrapolate where the grid has more
    patches than the reference and interpolate where it has fewer, so no axis spans less than the trained extent
    (extrapolated, a narrower image is a narrower object to the model: docs/resolution_transfer.md, finding 7).
    ``ref_grid=None`` means the grid is its own reference.
    """
    h, w = to_2tuple(grid_size, "grid_size")
    ref = (h, w) if ref_grid is None else to_2tuple(ref_grid, "ref_grid")
    return cell_coords(grid_cells((h, w), device), pair(w, h, device=device), ref, mode, dtype)


def grid_cells(grid_size: Size2, device: Optional[torch.device] = None) -> Tensor:
    """Every cell of an ``(h, w)`` token grid in token order (row-major): ``(h*w, 2)`` long ``(column, row)``."""
    h, w = to_2tuple(grid_size, "grid_size")
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([cols.flatten(), rows.flatten()], dim=-1)


def random_keep(rows: int, n: int, keep: float, generator: Optional[torch.Generator] = None,
                device: Optional[torch.device] = None) -> Tensor:
    """Token dropping's draw (FLIP, Li et al. CVPR 2023; NaViT): for each of ``rows`` images of ``n`` tokens, a random
    ``keep`` fraction of them (at least one), a different subset per image, as indices ``(rows, k)`` in token order."""
    if not 0 < keep <= 1:
        raise ValueError(f"token_keep must be in (0, 1], got {keep}")
    k = max(1, int(round(keep * n)))
    noise = torch.rand(rows, n, generator=generator, device=generator.device if generator is not None else device)
    return (noise if device is None else noise.to(device)).argsort(1)[:, :k].sort(1).values


def content_tokens(images: Tensor, patch_size: int, keep: float) -> Tensor:
    """Content-aware token dropping: for each image of ``images`` ``(B, C, H, W)``, the ``keep`` fraction of its
    patches (at least one) that differ most from its background, as indices ``(B, k)`` in token order (row-major).

    The background is the median of the image's border pixels per channel; a patch's content is its mean absolute
    difference from it. Deterministic, so training and evaluation keep the same patches of the same image (on
    Fashion-MNIST 31% of the 4x4 patches are exactly background)."""
    if not 0 < keep <= 1:
        raise ValueError(f"content_keep must be in (0, 1], got {keep}")
    with torch.no_grad():
        border = torch.cat([images[..., 0, :], images[..., -1, :], images[..., 1:-1, 0], images[..., 1:-1, -1]], dim=-1)
        border = border.float()
        if torch.jit.is_tracing():  # an ONNX export: sizes stay formulas of the input's, and ONNX has no median
            half = (torch.as_tensor(border.shape[-1]) + 1) // 2
            background = border.topk(half, dim=-1, largest=False).values.amax(-1)  # the lower median, as torch's
        else:
            background = border.median(dim=-1).values
        background = background[..., None, None]  # (B, C, 1, 1)
        score = F.avg_pool2d((images.float() - background).abs(), patch_size).sum(1).flatten(1)  # (B, N)
        n = score.shape[1]
        if torch.jit.is_tracing():
            k = torch.round(torch.as_tensor(n) * keep).clamp(min=1).long()
        else:
            k = max(1, int(round(keep * n)))
        return score.topk(k, dim=1, sorted=False).indices.sort(1).values


def cell_coords(cells: Tensor, sizes: Tensor, ref: Size2, mode: CoordMode = "interpolate", dtype: torch.dtype = torch.float32) -> Tensor:
    """Coordinates of tokens given by their cell in their own image's grid: the one formula of patch coordinates.

    ``cells`` ``(..., 2)`` ``(column, row)`` and ``sizes`` ``(..., 2)`` ``(w, h)`` of each token's image grid (any
    leading shape, broadcasting: a packed row mixes images of different sizes); ``ref`` ``(h, w)``. Returns ``(..., 2)``
    ``(x, y)`` (computed in float64, returned as ``dtype``): ``(c + 0.5) * ref / n - 0.5`` per axis in interpolate mode (the half-pixel convention of
    ``F.interpolate(align_corners=False)``: ``n`` patches span the reference extent), ``c`` in extrapolate mode,
    ``2 (c + 0.5) / n - 1`` in normalize mode (DINOv3's box ``[-1, 1]``, independent of the reference grid), and per
    axis ``c`` where ``n`` exceeds the reference, the interpolate formula elsewhere, in extend mode.
    """
    rh, rw = to_2tuple(ref, "ref_grid")
    mode = CoordMode.parse(mode)
    c, n = cells.to(torch.float64), sizes.to(torch.float64)
    if mode in ("interpolate", "extend"):
        ref_wh = torch.tensor([rw, rh], device=c.device, dtype=torch.float64)
        scale = ref_wh / n
        out = c * scale + (0.5 * scale - 0.5)
        return (out if mode == "interpolate" else torch.where(n > ref_wh, c, out)).to(dtype)
    if mode == "extrapolate":
        return c.to(dtype)
    return ((2 * c + 1) / n - 1).to(dtype)  # normalize


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
    given_extent: Optional[Tuple[float, float]] = None  # (w, h) of coordinates given directly, when the caller knows it
    from_mode: InitVar[bool] = False  # made here from the mode (create, transformed): nothing to check
    batched: ClassVar[bool] = False  # one grid shared by every image of the batch
    images_per_row: ClassVar[int] = 1

    def __post_init__(self, from_mode: bool) -> None:
        # A grid with a mode is that mode's lattice (augmented by ``affine``): the bias families read a lattice's step
        # from its mode, not from ``coords``, so coordinates that contradicted it would be ignored without a word. Grids
        # made any other way than from the mode (dataclasses.replace, the constructor) are checked.
        if from_mode or self.mode is None or torch.jit.is_tracing() or torch.compiler.is_compiling():
            return
        want = PatchGrid.create(self.size, self.ref, self.mode, device=self.coords.device)
        if self.affine is not None:
            want = want.transformed(*self.affine)
        if self.coords.shape != want.coords.shape or not torch.allclose(self.coords.to(want.coords), want.coords, rtol=1e-5, atol=1e-5):
            h, w = self.size
            raise ValueError(f"these coordinates are not the {h}x{w} grid's in coordinate mode {self.mode!r}"
                             f"{'' if self.affine is None else ' with its augmentation'}: a PatchGrid with a mode holds that "
                             "mode's lattice; give other coordinates with PatchGrid.from_coords (no mode)")
        if self.spacing is not None and not all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(self.spacing, want.spacing)):
            raise ValueError(f"spacing {self.spacing} is not the {self.mode!r} lattice's {want.spacing}: build the grid with "
                             "PatchGrid.create, or give other coordinates with PatchGrid.from_coords")

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
        if traced(size):  # an exported graph: no lattice shortcut or cache key computed from one size's numbers
            return cls(size, ref, coords, None, None, mode, from_mode=True)
        spacing = (_spacing(size[1], ref[1], mode), _spacing(size[0], ref[0], mode))
        key = (size, ref, mode, coords.device)
        return cls(size, ref, coords, spacing, key, mode, from_mode=True)

    @classmethod
    def from_coords(cls, coords: Tensor, grid_size: Size2, ref_grid: Size2,
                    extent: Optional[Tuple[float, float]] = None) -> "PatchGrid":
        """Arbitrary coordinates (augmented, jittered, ...) in reference patches: no lattice shortcut, no caching.
        ``extent``: the ``(w, h)`` the image spans in those units (FIRE's normaliser, RoPE scaling's length ratio);
        by default measured from the coordinates' span (:meth:`extent`)."""
        size, ref = to_2tuple(grid_size, "grid_size"), to_2tuple(ref_grid, "ref_grid")
        if coords.shape != (size[0] * size[1], 2):
            raise ValueError(f"coords must have shape ({size[0] * size[1]}, 2) for grid {size}, got {tuple(coords.shape)}")
        if extent is not None and not (len(extent) == 2 and all(0 < float(e) < math.inf for e in extent)):
            raise ValueError(f"extent must be (w, h), two positive numbers, got {extent!r}")
        return cls(size, ref, coords.float(), None, None, given_extent=None if extent is None else tuple(float(e) for e in extent))

    @property
    def is_reference(self) -> bool:
        """True when this is the reference grid itself, unaugmented (in any coordinate mode): tables learned there
        (``learned``, ``rel_bias``) are then used exactly as trained."""
        return self.key is not None and self.size == self.ref and self.mode is not None

    def extent(self) -> Tensor:
        """``(2,)`` ``(w, h)`` the image spans in coordinate units (patches times spacing, augmentation's scale
        included): the reference extent in interpolate mode, the grid's own in extrapolate mode, 2 in normalize mode,
        per axis the larger of the two in extend mode.
        The normaliser of FIRE, and the length ratio that RoPE's extrapolation controls read. Coordinates given
        directly (no mode) span ``(n - 1)`` spacings of an ``n``-patch axis, so their extent is ``span * n / (n - 1)``,
        unless :meth:`from_coords` was given it."""
        if self.given_extent is not None:
            return torch.tensor(self.given_extent, device=self.coords.device, dtype=torch.float32)
        if self.mode is None:
            n = pair(self.size[1], self.size[0], device=self.coords.device, dtype=torch.float32)
            span = self.coords.amax(0) - self.coords.amin(0)
            return torch.where(n > 1, span * n / (n - 1).clamp(min=1), torch.ones_like(n))
        return _extent(pair(self.size[1], self.size[0], device=self.coords.device), self.ref, self.mode,
                       None if self.affine is None else torch.tensor(self.affine[:2], device=self.coords.device))

    def step(self) -> Optional[Tensor]:
        """``(2,)`` ``(sx, sy)``: the distance between neighbouring patch centres of a regular grid, as a tensor (also
        in an exported graph, whose grids keep no ``spacing`` numbers); ``None`` for coordinates given directly."""
        if self.spacing is not None:
            return torch.tensor(self.spacing, dtype=torch.float32)
        if self.mode is None or self.affine is not None:
            return None
        unit = torch.tensor([[0, 0], [1, 1]], device=self.coords.device)
        c = cell_coords(unit, pair(self.size[1], self.size[0], device=self.coords.device), self.ref, self.mode)
        return c[1] - c[0]

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
        return PatchGrid(self.size, self.ref, coords, spacing, None, self.mode, (sx, sy, tx, ty), from_mode=self.mode is not None)

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


def _extent(sizes: Tensor, ref: Tuple[int, int], mode: Optional[str], scale: Optional[Tensor] = None) -> Tensor:
    """``(..., 2)`` ``(w, h)`` extent in coordinate units of images whose grids are ``sizes`` ``(..., 2)`` ``(w, h)``."""
    if mode is None:
        raise ValueError("these coordinates were given directly, so their image extent is unknown; build the grid with "
                         "PatchGrid.create or a TokenGrid with cells and sizes")
    n = sizes.to(torch.float32)
    ref_wh = torch.tensor([ref[1], ref[0]], device=n.device, dtype=torch.float32)
    out = {"interpolate": ref_wh.expand_as(n), "extrapolate": n, "normalize": torch.full_like(n, 2.0),
           "extend": torch.maximum(n, ref_wh)}[mode]
    return out if scale is None else out * scale.to(out)


def reference_extent(ref: Size2, mode: Optional[str]) -> Tensor:
    """``(2,)`` ``(w, h)``: the extent of the reference grid ``ref`` itself in coordinate mode ``mode`` (what a trained
    model saw; RoPE's extrapolation controls scale frequencies by an image's extent over this)."""
    h, w = to_2tuple(ref, "ref_grid")
    return _extent(torch.tensor([w, h]), (h, w), mode)


def patch_units(x: Tensor, grid: Union["PatchGrid", "TokenGrid"], offsets: bool = False) -> Tensor:
    """Coordinates ``x`` ``(..., 2)`` of ``grid`` (or, ``offsets=True``, differences of them) in reference patches:
    the unit of tables learned on the reference grid (``learned``, ``rel_bias``, ``cpb``). Only normalize mode differs:
    its box ``[-1, 1]`` spans the reference grid, so ``x_patch = (x + 1) ref / 2 - 0.5``."""
    if grid.mode != "normalize":
        return x
    half = torch.tensor([grid.ref[1] / 2, grid.ref[0] / 2], device=x.device, dtype=x.dtype)
    return x * half if offsets else (x + 1) * half - 0.5


def _affine(coords: Tensor, centre: Tensor, affine: Tensor) -> Tensor:
    """Scale ``(sx, sy)`` about ``centre``, then shift ``(tx, ty)``: ``affine`` ``(..., 4)`` per token. Written as
    ``c * s + (centre * (1 - s) + t)`` so that the identity gives ``coords`` back bit for bit."""
    s, t = affine[..., :2], affine[..., 2:]
    return coords * s + (centre * (1 - s) + t)


@dataclass(frozen=True, eq=False)
class TokenGrid:
    """Coordinates per image: what a batch of token-dropped, per-image augmented or packed images hands every PE.

    Row ``b`` of the batch holds ``N`` tokens; token ``n`` is cell ``cells[b, n]`` ``(column, row)`` of an image whose
    grid is ``sizes[b, n]`` ``(w, h)``, at ``coords[b, n]`` ``(x, y)``. A row holds one image, or, packed (NaViT),
    up to ``images_per_row`` images told apart by ``segments[b, n]`` (slot ``0..K-1``; ``-1``: padding), whose tokens
    attend only to their own image. ``affine`` ``(B, N, 4)`` is a per-image augmentation (scale about the image
    centre, then shift), kept so that :meth:`in_mode` can redo the coordinates in another mode. ``images``
    ``(M, 2)`` gives the ``(row, slot)`` of each packed image in input order. ``cells=None``: coordinates given
    directly (no mode change, no grid for PEG). Never cached: ``key`` is always None.
    """

    ref: Tuple[int, int]
    coords: Tensor
    cells: Optional[Tensor] = None
    sizes: Optional[Tensor] = None
    mode: Optional[str] = None
    affine: Optional[Tensor] = None
    segments: Optional[Tensor] = None
    images: Optional[Tensor] = None
    images_per_row: int = 1
    canvas: Optional[Tuple[int, int]] = None  # (h, w) of the largest image grid, known where the grid is made
    # Every image's tokens share one affine, so each image is still a lattice (the bias families' fast path); known
    # where the affine is made, so that nothing reads data to find it out (torch.compile traces it).
    affine_per_image: bool = True
    batched: ClassVar[bool] = True
    key: ClassVar[None] = None
    spacing: ClassVar[None] = None
    is_reference: ClassVar[bool] = False

    def __post_init__(self) -> None:
        c = self.coords
        if c.dim() != 3 or c.shape[-1] != 2:
            raise ValueError(f"per-image coordinates must have shape (B, N, 2) (x, y per token), got {tuple(c.shape)}")
        for name in ("cells", "sizes", "affine", "segments"):
            t = getattr(self, name)
            want = c.shape[:2] + ((4,) if name == "affine" else () if name == "segments" else (2,))
            if t is not None and t.shape != want:
                raise ValueError(f"TokenGrid.{name} must have shape {tuple(want)} to match coords {tuple(c.shape)}, got {tuple(t.shape)}")

    @classmethod
    def from_coords(cls, coords: Tensor, ref_grid: Size2) -> "TokenGrid":
        """Arbitrary per-image coordinates ``(B, N, 2)``: every PE but PEG (which needs a grid) and per-part modes."""
        return cls(to_2tuple(ref_grid, "ref_grid"), coords.float())

    @classmethod
    def from_grid(cls, grid: PatchGrid, batch: int) -> "TokenGrid":
        """``grid`` given to each of ``batch`` images: the starting point of dropping and per-image augmentation (a
        batch-level augmentation of ``grid`` is kept, the same for every image)."""
        if grid.mode is None:
            raise ValueError("TokenGrid.from_grid needs a grid made by PatchGrid.create (these coordinates were given directly); "
                             "use TokenGrid.from_coords")
        h, w = grid.size
        dev = grid.coords.device
        cells = grid_cells((h, w), dev).expand(batch, -1, -1)
        sizes = torch.tensor([w, h], device=dev).expand(batch, h * w, 2)
        affine = None if grid.affine is None else torch.tensor(grid.affine, device=dev, dtype=torch.float32).expand(batch, h * w, 4)
        return cls(grid.ref, grid.coords.expand(batch, -1, -1), cells, sizes, grid.mode, affine, canvas=grid.size)

    @property
    def size(self) -> Tuple[int, int]:
        """``(h, w)`` of the largest image grid: the canvas a grid convolution (PEG) scatters tokens onto."""
        if self.canvas is not None:
            return self.canvas  # no data-dependent read: torch.compile traces it
        if self.sizes is None:
            raise ValueError("these per-image coordinates were given directly (TokenGrid.from_coords): they have no grid")
        w, h = self.sizes.flatten(0, 1).amax(0).tolist()
        return int(h), int(w)

    def extent(self) -> Tensor:
        """``(B, N, 2)`` each token's image extent ``(w, h)`` in coordinate units (see :meth:`PatchGrid.extent`)."""
        if self.sizes is None:
            return _extent(self.coords[..., :0], self.ref, None)
        return _extent(self.sizes, self.ref, self.mode, None if self.affine is None else self.affine[..., :2])

    def _centres(self) -> Tensor:
        """Each token's image centre in this grid's coordinate mode (what rescaling is about)."""
        return cell_coords((self.sizes - 1).double() / 2, self.sizes, self.ref, self.mode)

    def augmented(self, affine: Tensor, per_image: bool = False) -> "TokenGrid":
        """Scale ``(sx, sy)`` about each image's centre, then shift ``(tx, ty)``: ``affine`` ``(B, 4)`` one per row, or
        ``(B, N, 4)`` per token; composed with an earlier augmentation. ``per_image=True`` promises that a per-token
        ``affine`` is one per image (equal over each image's tokens, as :class:`CoordAugment` draws for a packed row):
        the bias families then keep their per-image lattice path instead of evaluating every pair."""
        if self.cells is None:
            raise ValueError("augmenting per-image coordinates needs their grid cells (a TokenGrid from from_grid or packing)")
        affine = affine.to(self.coords.device, torch.float32)
        if affine.dim() == 2:
            affine = affine[:, None]
        per_image = per_image or affine.shape[1] == 1  # one per row: every image of the row shares it
        affine = affine.expand(-1, self.coords.shape[1], -1)
        coords = _affine(self.coords, self._centres(), affine)
        if self.affine is not None:  # scaling about the centre keeps the earlier shift: scales multiply, shifts add
            affine = torch.cat([self.affine[..., :2] * affine[..., :2], self.affine[..., 2:] + affine[..., 2:]], -1)
        per_image = per_image and (self.affine is None or self.affine_per_image)
        return dataclasses.replace(self, coords=coords, affine=affine, affine_per_image=per_image)

    def in_mode(self, mode: Optional[str]) -> "TokenGrid":
        """The same tokens with coordinates in coordinate mode ``mode`` (``None``: unchanged), augmentation kept."""
        if mode is None or mode == self.mode:
            return self
        if self.cells is None:
            raise ValueError(
                f"a positional encoding with its own coord_mode={mode!r} needs grid cells; these coordinates were given "
                "directly (TokenGrid.from_coords): drop the part's coord_mode"
            )
        grid = dataclasses.replace(self, coords=cell_coords(self.cells, self.sizes, self.ref, mode), mode=mode, affine=None)
        return grid if self.affine is None else grid.augmented(self.affine, self.affine_per_image)

    def take(self, index: Tensor) -> "TokenGrid":
        """The tokens ``index`` ``(B, n)`` of each row (token dropping), every per-token field with them."""
        def pick(t: Optional[Tensor]) -> Optional[Tensor]:
            if t is None:
                return None
            return t.gather(1, index if t.dim() == 2 else index[..., None].expand(-1, -1, t.shape[-1]))

        return dataclasses.replace(self, coords=pick(self.coords), cells=pick(self.cells), sizes=pick(self.sizes),
                                   affine=pick(self.affine), segments=pick(self.segments))

    def keep_random(self, keep: float, generator: Optional[torch.Generator] = None) -> "TokenGrid":
        """A random ``keep`` fraction of each row's tokens (:func:`random_keep`). One image per row only."""
        if self.segments is not None:
            raise ValueError("token dropping works on one image per row; drop before packing")
        return self.take(random_keep(*self.coords.shape[:2], keep, generator, self.coords.device))

    def rebased(self, ref: Tuple[int, int], mode: str) -> "TokenGrid":
        """These tokens' coordinates in units of reference grid ``ref`` and coordinate mode ``mode`` (a model's own)."""
        if self.ref == ref and self.mode == mode:
            return self
        if self.cells is None:
            raise ValueError(f"coordinates given directly are in units of ref grid {self.ref}; the model's is {ref}")
        grid = dataclasses.replace(self, ref=ref, mode=None, affine=None).in_mode(mode)
        return grid if self.affine is None else grid.augmented(self.affine, self.affine_per_image)

    def to(self, device: torch.device) -> "TokenGrid":
        move = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **move)


@dataclass(frozen=True)
class CoordAugment:
    """Random shift, rescale and aspect jitter of the patch coordinates while training, drawn per image (CAPE,
    Likhomanenko et al., NeurIPS 2021; DINOv3's RoPE augmentation, Simeoni et al. 2025): the model learns that
    positions are relative and scale-free, which helps at unseen resolutions. Off by default (all identities).

    ``shift``: offset drawn uniformly in ``[-shift, shift]`` coordinate units per axis (reference patches; in
    normalize mode the box ``[-1, 1]``, as DINOv3's ``shift_coords``).
    ``rescale``: one factor drawn log-uniformly in ``[1/rescale, rescale]``, about the image centre.
    ``jitter``: a further per-axis factor drawn log-uniformly in ``[1/jitter, jitter]``.
    ``per_image``: one draw per image (a :class:`TokenGrid`; bias encodings then build one bias per image), or
    ``False``: one per batch, as DINOv3 draws (the grid stays shared, biases and matrix rotations too: with liere or
    comrope a draw per image costs matrix exponentials per image). Draws come from torch's global generator.
    """

    shift: float = 0.0
    rescale: float = 1.0
    jitter: float = 1.0
    per_image: bool = True

    def __post_init__(self) -> None:
        if self.shift < 0 or self.rescale < 1 or self.jitter < 1:
            raise ValueError(f"coord_aug needs shift >= 0, rescale >= 1 and jitter >= 1, got {self}")

    @property
    def active(self) -> bool:
        return self.shift > 0 or self.rescale > 1 or self.jitter > 1

    def draw(self, n: int) -> Tensor:
        """``n`` affine transforms ``(n, 4)`` ``(sx, sy, tx, ty)``."""
        u = 2 * torch.rand(n, 5, dtype=torch.float64) - 1
        scale = torch.exp(u[:, 0] * math.log(self.rescale))
        sx = scale * torch.exp(u[:, 1] * math.log(self.jitter))
        sy = scale * torch.exp(u[:, 2] * math.log(self.jitter))
        return torch.stack([sx, sy, u[:, 3] * self.shift, u[:, 4] * self.shift], -1)

    def __call__(self, grid: Union[PatchGrid, TokenGrid], batch: int = 1) -> Union[PatchGrid, TokenGrid]:
        """``grid`` augmented: per image (``batch`` rows; a packed row draws once per image), or once for the batch."""
        if not self.per_image:
            if grid.batched:
                raise ValueError("coord_aug.per_image=False needs a shared grid; per-image grids take per-image draws")
            return grid.transformed(*self.draw(1)[0].tolist())
        if not grid.batched:
            grid = TokenGrid.from_grid(grid, batch)
        if grid.segments is None:
            return grid.augmented(self.draw(grid.coords.shape[0]))
        rows, k = grid.coords.shape[0], grid.images_per_row
        table = self.draw(rows * k + 1).to(grid.coords.device)  # one per (row, slot); padding takes the last
        slot = torch.where(grid.segments < 0, rows * k, torch.arange(rows, device=table.device)[:, None] * k + grid.segments)
        return grid.augmented(table[slot], per_image=True)
