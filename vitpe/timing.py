"""Timing side by side: each function measured in turns within one process, so drift hits all of them alike.

The one implementation the benchmark scripts share (speed, token dropping, packing)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch

__all__ = ["timed", "alternate", "ratio"]


def timed(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def alternate(fns: Dict[str, Callable[[], None]], iters: int, rounds: int, device: torch.device) -> Dict[str, List[float]]:
    """Seconds per call of each function in every round, measured in turns. The order rotates from round
    to round so that no function always runs first (after the others warmed or cooled the caches)."""
    for fn in fns.values():  # warm-up (and compilation)
        timed(fn, 2, device)
    names = list(fns)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(timed(fns[k], iters, device))
    return times


def ratio(times: Dict[str, List[float]], num: str, den: str) -> Dict[str, float]:
    """``num``'s time over ``den``'s (den's speed relative to num's): the median of the per-round ratios and their range."""
    r = [a / b for a, b in zip(times[num], times[den])]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}
