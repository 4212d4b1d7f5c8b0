"""Timing side by side: each function measured in turns within one process, so drift hits all of them alike.

The one implementation the benchmark scripts share (speed, token dropping, packing, CPU levers): timing, a training
step to time, its FLOPs, and the matmul peak they are measured against."""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

__all__ = ["timed", "alternate", "ratio", "step_fn", "flops_per_call", "matmul_peak", "cpu_name", "usable_cores"]


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


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: Optional[torch.dtype] = None, train: bool = True,
            optimizer: Optional[torch.optim.Optimizer] = None) -> Callable[[], None]:
    """One training step (forward, cross-entropy, backward, AdamW unless ``optimizer`` is given) or, ``train=False``, one
    no-grad forward, on a fixed batch; ``dtype``: autocast to it."""
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx = (lambda: torch.autocast(x.device.type, dtype=dtype)) if dtype else contextlib.nullcontext

    def train_step():
        with ctx():
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    @torch.no_grad()
    def infer_step():
        with ctx():
            model(x)

    model.train(train)
    return train_step if train else infer_step


def flops_per_call(fn: Callable[[], None]) -> int:
    """FLOPs of one call of ``fn`` (``torch.utils.flop_counter``: matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an ``n x n`` matrix product in ``dtype``: the ceiling a training step's FLOP/s is compared with."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, 3, device)
    s = min(s, timed(lambda: a @ b, 5, device))
    return 2 * n**3 / s


def cpu_name() -> str:
    """The processor's model name (Linux), so a timing names the machine it was measured on."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one, as under taskset or a container's
    cpuset), which is what a benchmark or a study splits between its processes."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
