"""Absolute encodings added to the patch tokens: none, sin-cos, Fourier features, learned table."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.nn.init import trunc_normal_

from ..coords import PatchGrid, Size2, patch_units
from .base import PosEmbed
from .functional import fourier_features
from .registry import register_pos_embed

__all__ = ["NoPosEmbed", "SinCos2d", "FourierPosEmbed", "LearnedFourierPosEmbed", "LearnedPosEmbed", "FactorizedPosEmbed"]


# ---- the maths of this file's families (pure functions; maths that families share: functional.py) ----

def sincos_1d(pos: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Transformer sinusoidal encoding (Vaswani et al. 2017): ``(..., N) -> (..., N, dim)``.

    ``PE[p, 2i] = sin(p / base^(2i/dim))``, ``PE[p, 2i+1] = cos(p / base^(2i/dim))``. Because each pair
    is a point on a circle turning at rate ``w_i``, ``PE(p + k)`` is ``PE(p)`` rotated by ``w_i k``.
    """
    if dim % 2:
        raise ValueError(f"sincos_1d needs an even dim, got {dim}")
    omega = base ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float64) / dim)  # (dim/2,)
    phase = pos.to(torch.float64)[..., None] * omega  # (..., N, dim/2)
    if torch.onnx.is_in_onnx_export():  # onnxruntime before 1.24 has no float64 sin/cos: the angles, then float32 trig
        phase = phase.float()
    out = torch.stack([phase.sin(), phase.cos()], dim=-1).flatten(-2)  # interleave: sin, cos, sin, cos
    return out.to(pos.dtype if pos.is_floating_point() else torch.float32)


def sincos_2d(coords: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """2D sin-cos encoding: ``(N, 2) -> (N, dim) = cat([sincos_1d(x, dim/2), sincos_1d(y, dim/2)])``.

    Half the channels encode x, half y, as in MAE (He et al. 2022) and "Better plain ViT baselines"
    (Beyer et al. 2022), with the Transformer's interleaved sin/cos order inside each half.
    """
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4 (half for x, half for y, sin/cos pairs), got {dim}")
    return torch.cat([sincos_1d(coords[..., 0], dim // 2, base), sincos_1d(coords[..., 1], dim // 2, base)], dim=-1)


def resize_table(table: Tensor, size: Tuple[int, int], mode: str = "bicubic", antialias: bool = False,
                 align_corners: bool = False, square: bool = False) -> Tensor:
    """A learned table ``(1, dim, h, w)`` resized to the grid ``size`` as timm resizes it (``F.interpolate``, so its
    antialiasing and corner conventions). ``square``: resized to a square of the longer side, then its top-left
    ``size`` corner (NaFlex's aspect-preserving resize, patches keep their place whatever the shape)."""
    out_size = (max(size),) * 2 if square else tuple(size)
    if antialias and torch.onnx.is_in_onnx_export():  # ONNX has no antialiased resize: the same weights, as two products
        ry, rx = (antialias_weights(n, m, mode, table.device) for n, m in zip(out_size, table.shape[-2:]))
        out = torch.einsum("yh,bdhw,xw->bdyx", ry, table.float(), rx)
    else:
        out = F.interpolate(table.float(), size=out_size, mode=mode, antialias=antialias, align_corners=align_corners)
    return out[:, :, : size[0], : size[1]].to(table.dtype)


def antialias_weights(n_out: int, n_in: int, mode: str = "bicubic", device: Optional[torch.device] = None) -> Tensor:
    """``(n_out, n_in)`` weights of ``F.interpolate(..., antialias=True)`` along one axis (PIL's filters: Keys' cubic
    with ``a = -0.5``, or the triangle, stretched by the scale when shrinking, each row normalised to 1). Zero outside a
    filter's support, so the dense matrix is the windowed sum PyTorch computes, in ops an exported graph has."""
    i = torch.arange(n_out, device=device, dtype=torch.float32)
    j = torch.arange(n_in, device=device, dtype=torch.float32)
    scale = torch.as_tensor(n_in / n_out, dtype=torch.float32, device=device)
    x = ((j + 0.5)[None, :] - (i + 0.5)[:, None] * scale) / scale.clamp(min=1.0)
    a = x.abs()
    if mode == "bilinear":
        w = (1 - a).clamp(min=0)
    else:
        w = torch.where(a < 1, (1.5 * a - 2.5) * a * a + 1, torch.where(a < 2, ((a - 5) * a + 8) * a * -0.5 + 2.0, torch.zeros_like(a)))
    return w / w.sum(1, keepdim=True)


def sample_line(table: Tensor, pos: Tensor) -> Tensor:
    """Linear interpolation in a 1D table ``(L, dim)`` at continuous positions ``pos`` ``(...)`` in table entries,
    border values beyond it (``F.interpolate(mode="linear")``'s kernel; NaViT's factorized tables). Returns ``(..., dim)``."""
    n = table.shape[0]
    p = pos.to(table.dtype).clamp(0, n - 1)
    lo = p.floor().clamp(max=max(n - 2, 0))
    w = (p - lo).unsqueeze(-1)
    i = lo.long()
    return table[i] * (1 - w) + table[(i + 1).clamp(max=n - 1)] * w



@register_pos_embed("none")
class NoPosEmbed(PosEmbed):
    """No positional encoding: self-attention is permutation-equivariant, so the model sees a bag of
    patches (the baseline that shows why PE exists)."""

    reads_coords = False


@register_pos_embed("sincos2d")
class SinCos2d(PosEmbed):
    """Fixed 2D sin-cos encoding (Vaswani et al. 2017; 2D as in MAE, He et al. 2022, and "Better plain
    ViT baselines", Beyer et al. 2022), evaluated at continuous coordinates: ``sincos_2d(coords, dim)``."""

    acts_on = "tokens"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, base: float = 10000.0) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if dim % 4:
            raise ValueError(f"sincos2d needs dim divisible by 4, got dim={dim}")
        self.base = float(base)

    def tokens(self, grid: PatchGrid) -> Tensor:
        return self.memo(grid, "tokens", lambda: sincos_2d(grid.coords, self.dim, self.base))


@register_pos_embed("fourier")
class FourierPosEmbed(PosEmbed):
    """Random Gaussian Fourier features (Tancik et al., NeurIPS 2020): ``[cos 2 pi Bc, sin 2 pi Bc]`` with
    ``B ~ N(0, sigma^2)`` fixed at construction (saved in the state dict so a checkpoint reproduces it).

    ``sigma`` is in cycles per reference patch: 0.5 is the grid's Nyquist rate, so the default 0.2 keeps
    most frequencies resolvable on the reference grid.
    """

    acts_on = "tokens"

    def __init__(
        self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, sigma: float = 0.2, seed: Optional[int] = None
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if dim % 2:
            raise ValueError(f"fourier needs an even dim (cos and sin halves), got dim={dim}")
        if sigma <= 0:
            raise ValueError(f"fourier sigma must be positive, got {sigma}")
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        self.sigma = float(sigma)
        self.register_buffer("freqs", torch.randn(dim // 2, 2, generator=gen) * sigma)  # (dim/2, 2) B

    def tokens(self, grid: PatchGrid) -> Tensor:
        return self.memo(grid, "tokens", lambda: fourier_features(grid.coords, self.freqs.float()))


@register_pos_embed("fourier_learned")
class LearnedFourierPosEmbed(PosEmbed):
    """Learnable Fourier features + MLP (Li et al., "Learnable Fourier Features for Multi-Dimensional
    Spatial Positional Encoding", NeurIPS 2021): ``MLP(1/sqrt(F) [cos 2 pi Wc, sin 2 pi Wc])`` with ``W``
    trained, initialised ``N(0, sigma^2)`` in cycles per reference patch."""

    acts_on = "tokens"

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ref_grid: Size2,
        depth: int = 1,
        *,
        fourier_dim: int = 64,
        hidden_dim: Optional[int] = None,
        sigma: float = 0.2,
    ) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if fourier_dim % 2:
            raise ValueError(f"fourier_learned needs an even fourier_dim, got {fourier_dim}")
        hidden_dim = hidden_dim or dim
        self.freqs = nn.Parameter(torch.randn(fourier_dim // 2, 2) * sigma)  # (F/2, 2) W_r
        self.mlp = nn.Sequential(nn.Linear(fourier_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim))
        self.scale = fourier_dim**-0.5

    def tokens(self, grid: PatchGrid) -> Tensor:
        coords = grid.coords.to(self.freqs)
        return self.mlp(fourier_features(coords, self.freqs) * self.scale)


_SQUARE_REFUSAL = "{}.square takes the grid's longer side, a choice made per size outside the graph"


def _need_plain_grid(grid: PatchGrid, why: str) -> None:
    if grid.batched or grid.mode not in ("interpolate", "normalize") or grid.affine is not None:
        aug = " with augmentation" if grid.affine is not None else ""
        raise ValueError(f"{why} (timm's resample), which needs one plain interpolate-mode grid per batch; got coord mode "
                         f"{grid.mode}{aug}{' per image' if grid.batched else ''}")


@register_pos_embed("learned")
class LearnedPosEmbed(PosEmbed):
    """Learned absolute table at the reference grid (ViT, Dosovitskiy et al. 2021), sampled bicubically at
    other coordinates, the continuous form of timm's ``resample_abs_pos_embed``. Positions beyond the table
    (extrapolate mode) take the border value: a learned table knows nothing past what it was trained on.

    ``mode`` is the resampling kernel (``"bicubic"`` or ``"bilinear"``, as SigLIP and RADIO resize theirs).
    Three options resize the table to a whole grid as timm does, so they need plain interpolate-mode coordinates:
    ``antialias=True`` (timm's default ``F.interpolate(..., antialias=True)``, another bicubic kernel even when
    upsampling; the papers' code, ViT, DeiT and RoPE-ViT, does not), ``align_corners=True`` (the corner patches on the
    table's corners, C-RADIOv3) and ``square=True`` (NaFlex's aspect-preserving resize: the table resized to a square
    of the grid's longer side, the grid reading its top-left corner, so a patch keeps its place whatever the shape).
    """

    acts_on = "tokens"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, std: float = 0.02, antialias: bool = False,
                 mode: str = "bicubic", align_corners: bool = False, square: bool = False) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        if mode not in ("bicubic", "bilinear"):
            raise ValueError(f"learned.mode must be 'bicubic' or 'bilinear', got {mode!r}")
        self.table = nn.Parameter(torch.zeros(1, dim, *self.ref_grid))  # (1, dim, h, w)
        trunc_normal_(self.table, std=std)
        self.antialias, self.mode, self.align_corners, self.square = bool(antialias), mode, bool(align_corners), bool(square)

    def tokens(self, grid: PatchGrid) -> Tensor:
        if grid.is_reference:
            return self.table.flatten(2)[0].t()  # (N, dim): exactly the trained table
        if self.antialias or self.align_corners or self.square:
            _need_plain_grid(grid, "learned.antialias, learned.align_corners and learned.square resize the table to the whole grid")
            return resize_table(self.table, grid.size, self.mode, self.antialias, self.align_corners, self.square).flatten(2)[0].t()
        rh, rw = self.ref_grid
        c = patch_units(grid.coords.to(self.table.device), grid)  # (..., N, 2)
        # grid_sample(align_corners=False) puts pixel j's centre at normalised (2j + 1) / size - 1.
        norm = torch.stack([(2 * c[..., 0] + 1) / rw - 1, (2 * c[..., 1] + 1) / rh - 1], dim=-1)
        out = F.grid_sample(
            self.table, norm.reshape(1, 1, -1, 2).to(self.table.dtype), mode=self.mode, padding_mode="border", align_corners=False
        )  # (1, dim, 1, *N)
        return out[0, :, 0].t().reshape(*c.shape[:-1], self.dim)

    def size_choice(self) -> Optional[str]:
        return _SQUARE_REFUSAL.format("learned") if self.square else None

    def resampled_state(self, state: Dict[str, Tensor], from_grid: Size2) -> Dict[str, Tensor]:
        """The trained table (on ``from_grid``) as this table: what it gave on this reference grid in interpolate mode,
        sampled by its own rule (bicubic; timm's ``resample_abs_pos_embed`` where ``antialias`` is on, as for timm's models)."""
        trained = LearnedPosEmbed(self.dim, self.num_heads, from_grid, antialias=self.antialias, mode=self.mode,
                                  align_corners=self.align_corners, square=self.square)
        trained.load_state_dict(state)
        with torch.no_grad():
            tokens = trained.tokens(PatchGrid.create(self.ref_grid, from_grid, "interpolate", device=state["table"].device))
        return {"table": rearrange(tokens, "(h w) d -> 1 d h w", h=self.ref_grid[0]).contiguous()}

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """timm's ``pos_embed`` (ViT, DeiT, RoPE-ViT "+APE") becomes the table."""
        pos = weights.get("pos_embed")
        if pos is None:
            return {}
        h, w = self.ref_grid
        if tuple(pos.shape) == (1, h, w, self.dim):  # NaFlexVit keeps its table as a grid
            return {"table": rearrange(pos, "1 h w d -> 1 d h w")}
        if tuple(pos.shape) != (1, h * w, self.dim):
            raise ValueError(f"timm pos_embed {tuple(pos.shape)} does not fit a learned table of {h}x{w} positions and dim {self.dim}")
        return {"table": rearrange(pos, "1 (h w) d -> 1 d h w", h=h)}


@register_pos_embed("factorized")
class FactorizedPosEmbed(PosEmbed):
    """Factorized learned tables (NaViT, Dehghani et al. 2023; timm's NaFlexVit ``pos_embed='factorized'``): one table
    per axis, a patch's encoding the sum of its row's and its column's entries, ``h + w`` vectors instead of ``h w``.
    Other coordinates are sampled linearly in each table (timm's ``F.interpolate(mode="linear")``); beyond a table, its
    border value. ``square=True`` is NaFlex's aspect-preserving resize: both axes scaled by the grid's longer side, so
    a patch keeps its place whatever the shape (needs one plain interpolate-mode grid per batch)."""

    acts_on = "tokens"

    def __init__(self, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, *, std: float = 0.02, square: bool = False) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        h, w = self.ref_grid
        self.table_y, self.table_x = nn.Parameter(torch.zeros(h, dim)), nn.Parameter(torch.zeros(w, dim))
        trunc_normal_(self.table_y, std=std)
        trunc_normal_(self.table_x, std=std)
        self.square = bool(square)

    def tokens(self, grid: PatchGrid) -> Tensor:
        c = patch_units(grid.coords.to(self.table_x.device), grid)  # (..., N, 2) in table entries
        if self.square:
            _need_plain_grid(grid, "factorized.square scales both axes by the grid's longer side")
            h, w = grid.size
            # (c + 1/2) n / ref is the patch index + 1/2; on a table resized to the longer side L it lies at (j + 1/2) ref / L.
            n = torch.tensor([w / max(h, w), h / max(h, w)], device=c.device, dtype=c.dtype)
            c = (c + 0.5) * n - 0.5
        return sample_line(self.table_y, c[..., 1]) + sample_line(self.table_x, c[..., 0])

    def size_choice(self) -> Optional[str]:
        return _SQUARE_REFUSAL.format("factorized") if self.square else None

    def resampled_state(self, state: Dict[str, Tensor], from_grid: Size2) -> Dict[str, Tensor]:
        """Each trained table (on ``from_grid``) sampled at this reference grid's rows and columns in interpolate mode."""
        c = PatchGrid.create(self.ref_grid, from_grid, "interpolate").coords.reshape(*self.ref_grid, 2)  # (h, w, (x, y))
        return {"table_y": sample_line(state["table_y"], c[:, 0, 1].to(state["table_y"].device)),
                "table_x": sample_line(state["table_x"], c[0, :, 0].to(state["table_x"].device))}

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """NaFlexVit's ``pos_embed_y`` ``(1, h, dim)`` and ``pos_embed_x`` ``(1, w, dim)`` become the two tables."""
        if "pos_embed_y" not in weights:
            return {}
        y, x = weights["pos_embed_y"][0], weights["pos_embed_x"][0]
        if (y.shape[0], x.shape[0]) != tuple(self.ref_grid) or y.shape[1] != self.dim:
            raise ValueError(f"timm's factorized tables {tuple(y.shape)} and {tuple(x.shape)} do not fit a {self.ref_grid} grid of dim {self.dim}")
        return {"table_y": y, "table_x": x}
