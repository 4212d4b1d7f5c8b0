"""``gratings``: a 10-class dataset that fine detail decides, rendered natively at any size.

Each image holds one object, a disk or a square, filled with a sinusoidal grating of random orientation, phase and
contrast; the class is the container and how many cycles the grating makes across the object (five counts, 2 to 17).
Every pixel is the exact average of the scene over its area (the grating's box-filtered amplitude is analytic, the
edges are anti-aliased over a pixel), so a pixel is a measurement, not a point sample: at 32 px the two finest
gratings reach the pixel scale, lose their contrast and alias into coarser ones, and a model cannot tell them apart
however well it is trained; at 64 px they are resolved. A larger rendering therefore carries information the 32 px one
lacks, where Fashion-MNIST's larger sizes are upsampled copies. The contrast is random, so that a faded grating does
not betray a fine one by its contrast alone.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from .shapes import pixel_centres

__all__ = ["GRATINGS_CLASSES", "CYCLES", "gratings_params", "render_gratings", "zoomed_gratings"]

CYCLES = (2.0, 3.5, 6.0, 13.0, 17.0)  # grating cycles across the object's diameter: its class, with the container
CONTAINERS = ("disk", "square")
GRATINGS_CLASSES = tuple(f"{c}, {k:g} cycles" for c in CONTAINERS for k in CYCLES)
RADIUS = (0.22, 0.04)  # (smallest, range) of the object's radius, in image widths: 14-17 px across at 32 px
CONTRAST = (0.1, 0.3)  # (smallest, range) of the grating's amplitude
EDGE_MARGIN = 0.02
SQUARE_HALF = math.sqrt(math.pi) / 2  # a square of the disk's area: half-side in radii


def gratings_params(n: int, seed: int) -> dict:
    """Labels and continuous parameters of the first ``n`` samples of the split with this seed (image coordinates in
    ``[0, 1]``): the first ``k`` samples are the same for any ``n >= k``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, 12, generator=g, dtype=torch.float64).float()  # columns 10: unused (the square stands upright)
    label = (u[:, 0] * len(GRATINGS_CLASSES)).long().clamp_max(len(GRATINGS_CLASSES) - 1)
    radius = RADIUS[0] + RADIUS[1] * u[:, 1]
    centre = radius[:, None] + EDGE_MARGIN + (1 - 2 * radius[:, None] - 2 * EDGE_MARGIN) * u[:, 2:4]
    # Object and background far apart (one dark, one light, by at least 0.45 in every channel), so that the container
    # is plain to see and the grating is what the classes hinge on.
    dark = u[:, 4:5] < 0.5
    light, shade = 0.7 + 0.25 * u[:, 5:8], 0.05 + 0.2 * u[:, 8:11].roll(1, 1)
    background, colour = torch.where(dark, shade, light), torch.where(dark, light, shade)
    return {"label": label, "container": label // len(CYCLES), "cycles": torch.tensor(CYCLES)[label % len(CYCLES)],
            "centre": centre, "radius": radius, "angle": u[:, 8] * math.pi, "phase": u[:, 9] * 2 * math.pi,
            "turn": torch.zeros_like(u[:, 10]), "contrast": CONTRAST[0] + CONTRAST[1] * u[:, 11], "colour": colour,
            "background": background}


def zoomed_gratings(params: dict, boxes: Tensor) -> dict:
    """The scenes seen through square boxes ``(x0, y0, s, s)`` (image fractions), each box filling the image: the object
    ``1 / s`` times larger, the same number of cycles across it (its class), rendered at the new scale."""
    side = boxes[:, 2].to(params["radius"])
    return {**params, "centre": (params["centre"] - boxes[:, :2].to(params["centre"])) / side[:, None],
            "radius": params["radius"] / side}


def render_gratings(params: dict, size: Tuple[int, int] | int, chunk: int = 512) -> Tensor:
    """Render samples at ``size = (H, W)``: ``(n, 3, H, W)`` uint8, each pixel the scene's average over its area."""
    h, w = (size, size) if isinstance(size, int) else size
    n = params["label"].shape[0]
    out = torch.empty(n, 3, h, w, dtype=torch.uint8)
    gx, gy = pixel_centres(h, w).unbind(-1)
    px = 1.0 / min(h, w)  # one pixel, in image widths: the edges' anti-aliasing width
    for s in range(0, n, chunk):
        p = {k: v[s : s + chunk] for k, v in params.items()}
        col = lambda t: t[:, None, None]  # noqa: E731 (per sample, over the pixels)
        dx, dy = gx[None] - col(p["centre"][:, 0]), gy[None] - col(p["centre"][:, 1])
        r = col(p["radius"])
        turn = col(p["turn"])
        sx, sy = dx * turn.cos() + dy * turn.sin(), -dx * turn.sin() + dy * turn.cos()
        disk = (dx.square() + dy.square()).sqrt() - r
        square = torch.maximum(sx.abs(), sy.abs()) - SQUARE_HALF * r
        dist = torch.where(col(p["container"]) == 0, disk, square)
        cover = (0.5 - dist / px).clamp(0, 1)[:, None]  # (m, 1, H, W)
        freq = col(p["cycles"]) / (2 * r)  # cycles per image width
        fx, fy = freq * col(p["angle"]).cos(), freq * col(p["angle"]).sin()
        # A pixel averages the sinusoid over its w x h box: the amplitude times sinc in each axis (torch.sinc is sin(pi x)/(pi x)).
        fade = torch.sinc(fx / w) * torch.sinc(fy / h)
        wave = col(p["contrast"]) * fade * torch.sin(2 * math.pi * (fx * dx + fy * dy) + col(p["phase"]))
        inside = (p["colour"][:, :, None, None] + wave[:, None]).clamp(0, 1)
        img = p["background"][:, :, None, None] * (1 - cover) + inside * cover
        out[s : s + chunk] = (img * 255).round().to(torch.uint8)
    return out
