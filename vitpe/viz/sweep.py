"""A resolution sweep's pictures: top-1 and attention against input resolution, a line per run, mode and route, from
the rows :func:`vitpe.evaluation.evaluate_at` yields (and ``vitpe eval`` writes to results.json)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from .plots import draw_series, finish_plot, pyplot, wrapped

__all__ = ["plot_accuracy", "plot_attention"]


def _resolution_axis(ax, rows: List[Dict]) -> None:
    """The x axis of every sweep plot: resolution on a log scale, ticks at the evaluated sizes, the training sizes dotted."""
    ax.set_xscale("log", base=2)
    square = [r for r in rows if r["height"] == r["width"]] or rows  # non-square sizes are marked, not ticked (they crowd 1x)
    ticks = sorted({(r["height"] * r["width"]) ** 0.5 for r in square})
    ax.set_xticks(ticks, [next(r["resolution"] for r in square if (r["height"] * r["width"]) ** 0.5 == t) for t in ticks])
    ax.minorticks_off()
    lo, hi = min(ticks), max(ticks)
    for s in sorted({r["train_size"] for r in rows}):  # labelled, and inside the axes even when not evaluated there
        ax.axvline(s, color="grey", lw=0.8, ls=":")
        ax.annotate(f"trained at {s}", (s, 1), xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                    fontsize=7, color="grey", va="top", rotation=90)
        lo, hi = min(lo, s), max(hi, s)
    for span in sorted({r.get("train_sizes") for r in rows} - {None}):  # a run trained at several sizes: the range, shaded
        a, b = (int(v) for v in span.split("-"))
        ax.axvspan(a, b, color="grey", alpha=0.12, lw=0)
        ax.annotate(f"trained at {span}", (a, 1), xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                    fontsize=7, color="grey", va="top")
        lo, hi = min(lo, a), max(hi, b)
    ax.set_xlim(lo / 1.15, hi * 1.15)


def _xlabel(rows: List[Dict], *more: str) -> str:
    """The sweep plots' x label, naming the marks drawn on the axis."""
    marks = ["dotted: training resolution", *(["shaded: sizes trained at"] if any(r.get("train_sizes") for r in rows) else []), *more]
    return f"input resolution ({'; '.join(marks)})"


def _lines(ax, rows: List[Dict], value) -> None:
    """``value(row)`` against resolution, a line per label (square and non-square sizes by their area), at most
    ``MAX_LINES`` of them: further labels become one grey band (``draw_series``)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    series = {label: [((r["height"] * r["width"]) ** 0.5, value(r)) for r in rows if r["label"] == label and r["height"] == r["width"]]
              for label in labels}
    colours = draw_series(ax, series)
    for label, colour in colours.items():
        odd = [r for r in rows if r["label"] == label and r["height"] != r["width"]]
        for k, r in enumerate(odd):  # another aspect ratio: a labelled marker at its area
            x = (r["height"] * r["width"]) ** 0.5
            ax.plot([x], [value(r)], marker="s", mfc="none", color=colour)
            ax.annotate(r["resolution"], (x, value(r)), xytext=(5, 6 - 12 * (k % 2)), textcoords="offset points", fontsize=7,
                        color=colour, va="center")


def plot_accuracy(rows: List[Dict], path: Path, title: str) -> None:
    """Top-1 against resolution, a line per label, chance dashed, the training sizes marked."""
    rows = [r for r in rows if r["route"] != "native"]  # no one size: the table reports it
    fig, ax = pyplot().subplots(figsize=(7, 4.5), dpi=120)
    _lines(ax, rows, lambda r: 100 * r["top1"])
    _resolution_axis(ax, rows)
    for chance in sorted({r["chance"] for r in rows if r.get("chance")}):  # rows of older results have none
        ax.axhline(100 * chance, color="grey", lw=0.8, ls="--")
        ax.annotate(f"chance {100 * chance:.3g}%", (0, 100 * chance), xycoords=("axes fraction", "data"), xytext=(3, 2),
                    textcoords="offset points", fontsize=7, color="grey")
    ax.set_xlabel(_xlabel(rows, "dashed: chance"))
    ax.set_ylabel("top-1 accuracy (%)")
    finish_plot(fig, ax, title, path)


def plot_attention(rows: List[Dict], path: Path, title: str) -> None:
    """Attention against resolution, mean over layers: distance in patches (the model's coordinate unit: constant
    where a model attends as it did at its training size) and entropy over log(keys) (1: uniform; a fall far from
    the training size is the entropy collapse the extrapolation studies report)."""
    rows = [r for r in rows if r.get("attn_distance")]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4.5), dpi=120)
    mean = lambda xs: sum(x for x in xs if x is not None) / max(1, sum(x is not None for x in xs))  # noqa: E731
    _lines(left, rows, lambda r: mean(r["attn_distance"]) / r["patch_size"])
    _lines(right, rows, lambda r: mean(r["attn_entropy_norm"]))
    for ax, name in ((left, "mean attention distance (patches)"), (right, "attention entropy / log(keys)")):
        _resolution_axis(ax, rows)
        ax.set_xlabel(_xlabel(rows))
        ax.set_ylabel(f"{name}, mean over layers")
        ax.grid(alpha=0.3)
    right.set_ylim(0, 1.02)
    fig.suptitle(wrapped(title, fig))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
