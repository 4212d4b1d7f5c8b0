"""``shapes``: a CIFAR-style 10-class dataset drawn from continuous geometry.

Every sample is a list of shapes with parameters in normalised image coordinates ``[0, 1]``, so the same
sample renders at any resolution (32, 48, 64, 512, non-square...) with anti-aliased edges, and the
whole dataset is a deterministic function of ``(seed, index)``.

Classes 0-4 and 9 are told apart by *what* is in the image. Classes 5-8 contain the same two shapes,
a circle and a square, and differ only in *where* they are relative to each other; the shapes are kept
apart by more than a patch, so no single patch sees both. A ViT without positional encoding sees a bag
of patches and can only guess 5-8 (25%, 70% in all), except where a pair fills the image along its axis: with
little room to move, each shape's offset within its patches follows from the shapes' sizes and gives the arrangement away
(:func:`pair_play`; measured in benchmarks/shapes_leak.py).
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

__all__ = ["SHAPES_CLASSES", "POSITION_CLASSES", "shapes_params", "render_shapes", "pair_play", "on_canvas"]

SHAPES_CLASSES = (
    "circle",
    "square",
    "triangle",
    "ring",
    "cross",
    "circle above square",
    "square above circle",
    "circle left of square",
    "square left of circle",
    "two triangles",
)

# Shape kinds (the "what"), and per class the kinds of its first and second shape (-1: none).
CIRCLE, SQUARE, TRIANGLE, RING, CROSS = range(5)
_KINDS = torch.tensor([[0, -1], [1, -1], [2, -1], [3, -1], [4, -1], [0, 1], [1, 0], [0, 1], [1, 0], [2, 2]])
_ABOVE, _LEFT = (5, 6), (7, 8)
POSITION_CLASSES = _ABOVE + _LEFT  # the same two shapes: only where they are tells these apart
N_TEX = 3  # background texture: sinusoids of random direction, frequency and phase
TEXTURE_AMP = 0.05  # each sinusoid's amplitude scale (0: flat backgrounds)
# What a shape is should be easy to see, so that telling the arrangement classes apart is about position: shapes are
# large, upright and apart from the background (measured: with these, the main job's ViT learns every class).
SINGLE_RADIUS = (0.22, 0.08)  # (smallest, range): circumradius of a lone shape, in image widths
PAIR_RADIUS = (0.15, 0.04)  # ... of each shape of a pair
PAIR_GAP = (0.14, 0.06)  # (smallest, range): free space between a pair's shapes along their axis, over a patch (1/8)
MIN_CONTRAST = 0.5  # shapes differ from the background by at least this in some channel
ROTATION = 0.0  # shapes turn by up to this fraction of a full turn (0: upright)
CROSS_ARM = 0.4  # a cross's arm half-width, in its radii
EDGE_MARGIN = 0.03  # free space between a shape and the image's edge


def shapes_params(n: int, seed: int, start: int = 0) -> dict:
    """Labels and continuous geometry of samples ``start .. start+n`` of the dataset with this seed.

    Each sample's parameters depend only on ``(seed, index)``, so any slice is reproducible alone.
    """
    idx = torch.arange(start, start + n, dtype=torch.float64)
    # A counter-based generator: one independent stream per (seed, index), drawn in a fixed order.
    gens = [torch.Generator().manual_seed((seed * 1_000_003 + int(i)) % (2**63)) for i in idx]

    def draw(k: int) -> Tensor:
        return torch.stack([torch.rand(k, generator=g) for g in gens])  # (n, k) in [0, 1)

    u = draw(24)
    label = (u[:, 0] * len(SHAPES_CLASSES)).long().clamp_max(len(SHAPES_CLASSES) - 1)
    two = _KINDS[label, 1] >= 0
    r = torch.where(two[:, None], PAIR_RADIUS[0] + PAIR_RADIUS[1] * u[:, 1:3], SINGLE_RADIUS[0] + SINGLE_RADIUS[1] * u[:, 1:3])  # (n, 2) radii
    rot = u[:, 3:5] * 2 * math.pi * ROTATION
    # Single shapes: anywhere that keeps them inside the image.
    c1 = r[:, :1] + EDGE_MARGIN + (1 - 2 * r[:, :1] - 2 * EDGE_MARGIN) * u[:, 5:7]
    # Pairs: along one axis with a gap of at least PAIR_GAP[0] (more than a patch at patch size <= 1/8 image),
    # roughly aligned on the other axis.
    gap = PAIR_GAP[0] + PAIR_GAP[1] * u[:, 7]
    span = r[:, 0] + r[:, 1] + gap  # centre distance along the main axis
    lo = r[:, 0] + EDGE_MARGIN
    a1 = lo + (1 - EDGE_MARGIN - r[:, 1] - span - lo).clamp_min(0) * u[:, 8]  # first shape's main-axis centre
    a2 = a1 + span
    m = 0.5 + (0.5 - r.max(1).values - EDGE_MARGIN - 0.04) * (2 * u[:, 9] - 1)  # shared cross-axis centre
    jit = 0.04 * (2 * u[:, 10:12] - 1)
    # "above": the first shape has the smaller y; "left": the smaller x. Two triangles take either axis at
    # random, so for them the arrangement carries no label information.
    above = (label == _ABOVE[0]) | (label == _ABOVE[1]) | ((label == 9) & (u[:, 12] < 0.5))
    p_main = torch.stack([a1, a2], 1)
    p_cross = m[:, None] + jit
    pair_xy = torch.where(above[:, None, None], torch.stack([p_cross, p_main], -1), torch.stack([p_main, p_cross], -1))
    single_xy = torch.stack([c1, torch.full_like(c1, -10.0)], 1)  # (n, 2, 2); no second shape
    centres = torch.where(two[:, None, None], pair_xy, single_xy)
    # Colours: background and shapes apart by at least MIN_CONTRAST in some channel.
    bg = u[:, 14:17]
    fg = torch.stack([u[:, 17:20], u[:, 20:23]], 1)
    far = (fg - bg[:, None]).abs().amax(-1, keepdim=True) >= MIN_CONTRAST
    fg = torch.where(far, fg, (bg[:, None] + 0.5) % 1.0)
    tex = torch.stack([draw(4 * N_TEX)[:, i::4] for i in range(4)], -1)  # (n, N_TEX, 4): angle, freq, phase, amp
    return {"label": label, "kind": _KINDS[label], "centre": centres, "radius": r, "rotation": rot, "colour": fg, "background": bg, "texture": tex}


def pair_play(params: dict) -> Tensor:
    """How far each pair could have been placed elsewhere along its axis, in image widths (NaN for one shape): the
    room between the pair's outer edges and the image's margins. A pair with less play than a patch sits at nearly one
    offset from the patch grid for its sizes, which a model without position can read."""
    c, r = params["centre"].double(), params["radius"].double()
    axis = ((c[:, 1, 1] - c[:, 0, 1]).abs() > (c[:, 1, 0] - c[:, 0, 0]).abs()).long()  # 1: the pair is stacked in y
    rows = torch.arange(len(c))
    first, second = c[rows, 0, axis], c[rows, 1, axis]  # the first shape lies before the second on the axis
    play = ((first - r[:, 0] - EDGE_MARGIN) + (1 - EDGE_MARGIN - second - r[:, 1])).clamp_min(0)
    return torch.where(params["kind"][:, 1] >= 0, play, torch.full_like(play, float("nan")))


def on_canvas(params: dict, fraction: float) -> dict:
    """The same scenes shrunk to ``fraction`` of the image's side and centred on a larger canvas of their own
    background, texture continued: rendered at ``c`` px, the centre ``fraction * c`` px are the scene rendered at that
    size (within a grey level of rounding). A larger image whose content keeps its pixel scale (more tokens, no new
    content scale), the control for a native rendering at a larger size, where both change."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1]: the scene's share of the canvas side, got {fraction}")
    n = params["label"].shape[0]
    return framed(params, torch.full((n,), float(fraction)), torch.full((n, 2), (1 - fraction) / 2))


def framed(params: dict, fraction: Tensor, offset: Tensor) -> dict:
    """The same scenes drawn at ``fraction`` ``(n,)`` of the image's side with their corner at ``offset`` ``(n, 2)``
    ``(x, y)`` (image fractions): a canvas point ``u`` shows the scene's ``(u - offset) / fraction``. Below 1 the scene
    sits on a larger canvas of its own background (texture continued); above 1 the image is a window into the scene,
    magnified: content scale augmentation rendered natively (:func:`zoomed`), with no resampling blur."""
    tex = params["texture"].clone()
    angle = 2 * math.pi * tex[..., 0]
    freq = 1 + 2 * tex[..., 1]
    f, off = fraction.to(tex)[:, None], offset.to(tex)
    # render_shapes draws sin(2 pi (freq * proj + phase)) with proj = x cos + y sin; at a canvas point the scene point
    # is (u - offset) / fraction, so the frequency grows by 1 / fraction and the phase absorbs the offset.
    tex[..., 1] = (freq / f - 1) / 2
    tex[..., 2] = tex[..., 2] - freq / f * (off[:, 0, None] * angle.cos() + off[:, 1, None] * angle.sin())
    return {**params, "centre": off[:, None] + f[..., None] * params["centre"], "radius": f * params["radius"], "texture": tex}


def zoomed(params: dict, boxes: Tensor) -> dict:
    """The scenes seen through square boxes ``(x0, y0, s, s)`` (image fractions, :func:`vitpe.data.augment.crop_boxes`
    with ``square=True``), each box filling the image: the content ``1 / s`` times larger, rendered at the new scale."""
    side = boxes[:, 2]
    return framed(params, 1 / side, -boxes[:, :2] / side[:, None])


def _rotate(p: Tensor, angle: Tensor) -> Tensor:
    c, s = angle.cos()[..., None, None], angle.sin()[..., None, None]
    return torch.stack([c * p[..., 0] + s * p[..., 1], -s * p[..., 0] + c * p[..., 1]], -1)


def _sdf(kind: Tensor, p: Tensor, r: Tensor) -> Tensor:
    """Signed distance (normalised units, negative inside) of each sample's shape. ``p``: (n, H, W, 2)."""
    r = r[:, None, None]
    ax, ay = p[..., 0].abs(), p[..., 1].abs()
    circle = p.norm(dim=-1) - r
    square = torch.maximum(ax, ay) - r / math.sqrt(2)  # corners on the circle of radius r, at any rotation
    ring = (p.norm(dim=-1) - 0.8 * r).abs() - 0.22 * r
    arm = CROSS_ARM * r
    cross = torch.minimum(torch.maximum(ax - r, ay - arm), torch.maximum(ax - arm, ay - r))
    # Equilateral triangle of circumradius r: the max of the three edge half-planes.
    k = math.sqrt(3.0)
    e1 = p[..., 1] - r / 2
    e2 = (-k * p[..., 0] - p[..., 1]) / 2 - r / 2
    e3 = (k * p[..., 0] - p[..., 1]) / 2 - r / 2
    triangle = torch.maximum(e1, torch.maximum(e2, e3))
    out = torch.full_like(circle, 10.0)
    for kid, d in ((CIRCLE, circle), (SQUARE, square), (TRIANGLE, triangle), (RING, ring), (CROSS, cross)):
        out = torch.where((kind == kid)[:, None, None], d, out)
    return out


def pixel_centres(h: int, w: int) -> Tensor:
    """``(H, W, 2)``: the ``(x, y)`` centre of every pixel of an ``h x w`` image, in image fractions ``[0, 1]``: where a
    natively rendered dataset evaluates its scene."""
    ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h
    xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([gx, gy], -1)


def render_shapes(params: dict, size: Tuple[int, int] | int, chunk: int = 1024) -> Tensor:
    """Render samples at ``size = (H, W)``: a ``(n, 3, H, W)`` uint8 tensor. Edges are anti-aliased over
    one pixel at every resolution, so a larger rendering is a sharper view of the same picture."""
    h, w = (size, size) if isinstance(size, int) else size
    n = params["label"].shape[0]
    out = torch.empty(n, 3, h, w, dtype=torch.uint8)
    pix = pixel_centres(h, w)  # (H, W, 2) in [0, 1]
    px = 1.0 / min(h, w)  # one pixel, in normalised units: the anti-aliasing width
    for s in range(0, n, chunk):
        sl = slice(s, min(s + chunk, n))
        p = {k: v[sl].float() if v.is_floating_point() else v[sl] for k, v in params.items()}
        tex = p["texture"]  # (m, T, 4)
        ang, freq, phase, amp = (tex[..., i, None, None] for i in range(4))
        ang = ang * 2 * math.pi
        proj = pix[..., 0] * ang.cos() + pix[..., 1] * ang.sin()  # (m, T, H, W)
        shade = (TEXTURE_AMP * amp * torch.sin(2 * math.pi * (1 + 2 * freq) * proj + 2 * math.pi * phase)).sum(1)  # (m, H, W)
        img = (p["background"][:, :, None, None] + shade[:, None]).clamp(0, 1)  # (m, 3, H, W)
        for j in range(2):
            local = _rotate(pix[None] - p["centre"][:, j, None, None, :], p["rotation"][:, j])
            d = _sdf(p["kind"][:, j], local, p["radius"][:, j])
            cover = (0.5 - d / px).clamp(0, 1)[:, None]  # (m, 1, H, W)
            img = img * (1 - cover) + p["colour"][:, j, :, None, None] * cover
        out[sl] = (img * 255).round().to(torch.uint8)
    return out
