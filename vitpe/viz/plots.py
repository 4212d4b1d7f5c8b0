"""Drawing: matplotlib on the file-only Agg backend, one helper that ends every line plot, and the PE pictures."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["pyplot", "wrapped", "finish_plot", "draw_series", "draw_matrix", "draw_maps", "draw_distance", "MAX_LINES"]

MAX_LINES = 6  # more lines than this in one panel cannot be told apart: the rest are drawn as one grey band


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrapped(title: str, fig, fontsize: float = 12) -> str:
    """``title`` broken into lines that fit ``fig``'s width, so a long run name is never cut off at the edges."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.wrap(title, chars))


def finish_plot(fig, ax, title: str, path: Path) -> None:
    """Title, grid, legend, and save: the common end of every line plot."""
    ax.set_title(wrapped(title, fig))
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[1]) > 6:  # many lines: legend beside the plot, not over it
        fig.set_figwidth(fig.get_figwidth() + 3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)


def draw_series(ax, series: Dict[str, Sequence[Tuple[float, float]]], keep: Sequence[str] = (),
                colours: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Lines a reader can tell apart: at most MAX_LINES labelled series (those named in ``keep`` first, then the others in
    order), each in its own colour, and every further series folded into one grey band (their lowest to highest value at
    each x), labelled with how many it holds. ``colours`` fixes some series' colours (the same series alike in every
    panel of a figure). Returns the colour of each series drawn as a line."""
    names = [n for n in keep if n in series] + [n for n in series if n not in keep]
    shown, rest = names[:MAX_LINES], names[MAX_LINES:]
    if rest:
        at: Dict[float, List[float]] = {}
        for n in rest:
            for x, y in series[n]:
                if y is not None and math.isfinite(y):
                    at.setdefault(x, []).append(y)
        xs = sorted(at)
        ax.fill_between(xs, [min(at[x]) for x in xs], [max(at[x]) for x in xs], color="0.85", lw=0,
                        label=f"{len(rest)} others (range)", zorder=0)
    fixed = dict(colours or {})
    free = iter(c for c in (f"C{i}" for i in range(10)) if c not in fixed.values())
    drawn = {}
    for n in shown:
        pts = sorted(p for p in series[n] if p[1] is not None)
        drawn[n] = fixed.get(n) or next(free)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3.5, label=n, color=drawn[n])
    return drawn


def draw_matrix(mats: Dict[str, Tensor], title: str, path: Path) -> None:
    plt = pyplot()
    panels = [(k, m[0] if k == "bias" else m) for k, m in mats.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), dpi=110, squeeze=False)
    labels = {"tokens": ("dimension", "position (row-major)"), "bias": ("key position", "query position (head 0)"),
              "rotary": ("rotary pair (cos, sin)", "position (head 0, layer 0)")}
    for ax, (kind, m) in zip(axes[0], panels):
        im = ax.imshow(m.numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
        ax.set_xlabel(labels[kind][0])
        ax.set_ylabel(labels[kind][1])
        ax.set_title(f"{kind}")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(wrapped(title, fig))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_maps(maps: Dict[str, Tensor], query: Tuple[int, int], title: str, path: Path, max_heads: int = 6) -> None:
    plt = pyplot()
    panels = [(f"{k}" + (f" head {i}" if m.shape[0] > 1 else ""), m[i]) for k, m in maps.items() for i in range(min(m.shape[0], max_heads))]
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), dpi=110, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (name, m) in zip(axes.flat, panels):
        im = ax.imshow(m.numpy(), cmap="viridis", interpolation="nearest")
        ax.plot(query[1], query[0], marker="x", color="red", ms=8, mew=2)
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(wrapped(title, fig, 11), fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_distance(results: Dict[str, Tensor], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    for k, (label, d) in enumerate(results.items()):
        layers = torch.arange(d.shape[0]).float() + 1 + (k - (len(results) - 1) / 2) * 0.08
        for head in range(d.shape[1]):
            ax.scatter(layers, d[:, head], s=14, color=f"C{k}", label=label if head == 0 else None)
        ax.plot(layers, d.nanmean(1), color=f"C{k}", alpha=0.6)
    depth = max(d.shape[0] for d in results.values())
    ax.set_xticks(range(1, depth + 1))  # layers are whole numbers
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    finish_plot(fig, ax, title, path)

