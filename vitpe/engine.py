"""The runtime training and evaluation share: the device, mixed precision, per-step seeding, progress, and the memory
a step or a forward pass needs (planned before it runs, refused in one line where it cannot fit). The evaluation loop
itself is :mod:`vitpe.evaluation`'s."""
from __future__ import annotations

import contextlib
import random
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .data.memory import gib, host_memory_available  # noqa: F401 (gib: the name commands import from here)
from .errors import VitpeError

__all__ = ["resolve_device", "amp_dtype", "autocast", "seed_step", "Heartbeat", "progress_steps", "memory_available", "gib",
           "score_bytes", "attention_bytes", "forward_bytes", "train_step_bytes", "memory_plan", "MemoryPlanError"]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use device=cpu or auto")
    return dev


AMP_MODES = ("auto", "bf16", "fp16", "none")


def amp_dtype(amp: str, device: torch.device) -> Optional[torch.dtype]:
    """auto: bf16 on CUDA; on CPU off here (a training run measures instead: :func:`pick_cpu_amp`), since without native
    bf16 matmuls it is slower, not faster."""
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("amp=fp16 needs a CUDA device; use bf16 or none on CPU")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86's AMX and AVX-512 bf16 units; Arm's bf16 instructions


def cpu_bf16_units() -> Optional[str]:
    """The bf16 instructions this CPU reports (``"amx_bf16"``, ``"avx512_bf16"``, ``"bf16"``), ``""`` when it reports
    none (bf16 is then emulated: 13-25x slower on an AVX2 machine), None where the CPU's flags cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = {w for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features") for w in line.split(":", 1)[1].split()}
    return next((f for f in BF16_FLAGS if f in flags), "")


def pick_cpu_amp(step: Callable[[Optional[torch.dtype]], None], rounds: int = 4, warmup: int = 2, margin: float = 0.9
                 ) -> Tuple[Optional[torch.dtype], str]:
    """``train.amp=auto`` on a CPU: bf16 autocast where it is faster for this model, fp32 elsewhere. ``step(dtype)`` runs
    one training step's forward and backward; after ``warmup`` rounds of each, ``rounds`` rounds alternate fp32 and bf16
    (A B A B), and bf16 is taken when both its fastest and its median step take under ``margin`` of fp32's: a lucky or
    an unlucky round alone cannot decide. A CPU without bf16 units is not measured (emulated bf16 is far slower).
    Returns the dtype (None: fp32) and the line that says why."""
    units = cpu_bf16_units()
    if units == "":
        return None, "amp=auto: fp32 (this CPU has no bf16 units; amp=bf16 forces bf16)"
    times: Dict[Optional[torch.dtype], List[float]] = {None: [], torch.bfloat16: []}
    for k in range(warmup + rounds):
        for dtype in (None, torch.bfloat16):
            t0 = time.perf_counter()
            step(dtype)
            if k >= warmup:  # the first rounds warm each path up (allocation, kernel choice)
                times[dtype].append(time.perf_counter() - t0)
    fp32, bf16 = (sorted(v) for v in times.values())
    fastest, median = fp32[0] / bf16[0], fp32[len(fp32) // 2] / bf16[len(bf16) // 2]
    # bf16 must win clearly and steadily: a decision near 1x would flip between two runs of one config with the noise
    chosen = torch.bfloat16 if min(fastest, median) > 1 / margin else None
    return chosen, (f"amp=auto: bf16 autocast ran a step at {median:.2f}x the speed of fp32 ({fastest:.2f}x fastest against fastest; "
                    f"{units or 'bf16 units unknown'}; {rounds} alternating rounds): {'bf16' if chosen else 'fp32'} (amp=bf16 or "
                    "amp=none forces one)")


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class MemoryPlanError(VitpeError):
    """A size whose computation cannot fit in the memory there is; the message says what it needs and what fits."""

    exit_code = 2


def memory_available(device: torch.device) -> int:
    """Bytes a new computation on ``device`` can take: free GPU memory, or the system's available memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_memory_available()


def _tokens(model: nn.Module, size: Sequence[int], patch_size: Optional[int]) -> int:
    p = patch_size or model.patch_size
    return (size[0] // p) * (size[1] // p) + model.num_prefix_tokens


def score_bytes(heads: int, tokens: int) -> int:
    """Bytes one image holds where a layer's attention is computed explicitly (the attention diagnostics; autograd
    through an unfused kernel): every head's query-key scores, their softmax and one more of their size in float32."""
    return 3 * 4 * heads * tokens * tokens


def attention_bytes(model: nn.Module, size: Sequence[int], patch_size: Optional[int] = None) -> int:
    """:func:`score_bytes` of one image of ``size = (h, w)``: it grows with the 4th power of the side."""
    return score_bytes(model.blocks[0].attn.num_heads, _tokens(model, size, patch_size))


def forward_bytes(model: nn.Module, size: Sequence[int], patch_size: Optional[int] = None, explicit: bool = False) -> Tuple[int, int]:
    """What a vitpe ViT's inference at ``size = (h, w)`` holds at its peak, as ``(shared, per_image)`` bytes (measured
    within 1.5x for every family at three sizes, tests/test_reliability.py). Attention runs in SDPA's fused kernel, so
    an image holds one block's activations and what its PE appends to q and k; the batch shares the PE's bias tables
    (heads x tokens^2 floats each, as built and padded for the prefix tokens, with the index that spreads them) and its
    per-token tables. ``explicit``: attention computed as written, as onnxruntime runs an exported graph: each image
    also holds its scores and their softmax."""
    tokens, heads = _tokens(model, size, patch_size), model.blocks[0].attn.num_heads
    pe = _vitpe_pe(model)
    per_token, table_floats = (pe.infer_floats_per_token(), pe.table_floats_per_token()) if pe is not None else (0, 0)
    shared = _bias_bytes(model, tokens) + 4 * tokens * table_floats
    # a block's input, q, k, v and output, the MLP's hidden layer before and after its activation
    per_image = 4 * tokens * (5 * model.embed_dim + 2 * _hidden(model) + per_token) + (8 * heads * tokens**2 if explicit else 0)
    return shared, per_image


def _vitpe_pe(model: nn.Module):
    """The model's vitpe positional encoding, or None (no PE, or an unequipped timm model's table)."""
    pe = getattr(model, "pos_embed", None)
    return pe if hasattr(pe, "bias_tables") else None


def _hidden(model: nn.Module) -> int:
    """The width of a block's MLP hidden layer."""
    return model.blocks[0].mlp.fc2.in_features if hasattr(model.blocks[0].mlp, "fc2") else 4 * model.embed_dim


def _bias_bytes(model: nn.Module, tokens: int) -> int:
    """The attention bias tables a grid of ``tokens`` holds: heads x tokens^2 floats each, as built and as padded for the
    prefix tokens, and the int64 index that spreads them (a model without a vitpe PE: as if one bias per block)."""
    pe = _vitpe_pe(model)
    tables = pe.bias_tables if pe is not None else len(model.blocks)
    return 4 * tokens**2 * (2 * model.blocks[0].attn.num_heads * tables + 2) if tables else 0


def train_step_bytes(model: nn.Module, size: Sequence[int], batch: int) -> int:
    """What a training step of a vitpe ViT at ``size = (h, w)`` with ``batch`` images holds at its peak, as a bound
    (measured within 1.5x for every family, tests/test_reliability.py): each block's activations of every image kept for
    the backward pass (about 12 floats per token and channel, with the MLP's hidden width), what the PE keeps per token,
    the bias tables with their gradients, and, for a bias with trainable parameters (a learned table, an MLP), every image's
    attention probabilities in every block, since SDPA's fused CPU kernel gives no gradient for the bias."""
    tokens, heads, blocks = _tokens(model, size, None), model.blocks[0].attn.num_heads, len(model.blocks)
    pe = _vitpe_pe(model)
    floats = 10 * model.embed_dim + 2 * _hidden(model) + (pe.train_floats_per_token() if pe is not None else 0)
    per_image = blocks * 4 * tokens * floats
    if pe is None or pe.learned_bias:  # unknown: as if its bias had parameters
        per_image += blocks * 3 * 2 * heads * tokens**2  # probabilities saved, and the gradient being formed (1.5x measured)
    shared = 2 * _bias_bytes(model, tokens)  # the bias tables and their gradients
    return shared + batch * per_image


def memory_plan(model, sizes: List[Tuple[Tuple[int, int], Optional[int]]], batch_size: int, device: torch.device,
                source: str, train_size: Optional[Sequence[int]] = None, explicit: bool = False) -> Dict[Tuple[int, int], int]:
    """Images per batch at each size ``(h, w)`` of ``sizes`` (each with the patch size it runs at, None: the model's), so
    that a batch (:func:`forward_bytes`) takes at most half the memory available now; a size where one image cannot fit
    is refused here, before anything runs, with what it needs and the largest square size that fits. Said in one line
    each: sizes whose batch had to shrink, and sizes whose attention costs far more per image than at ``train_size``.
    ``explicit``: the attention is computed as written (onnxruntime), see :func:`forward_bytes`."""
    budget = memory_available(device) // 2
    out: Dict[Tuple[int, int], int] = {}
    shrunk, slow = [], []
    for hw, patch in sorted(dict.fromkeys(sizes), key=lambda s: s[1] or 0):  # the model's own patch (most tokens) first
        if hw in out:
            continue
        shared, each = forward_bytes(model, hw, patch, explicit)
        if shared + each > budget:
            side = next(s for s in range(model.patch_size, 100_000, model.patch_size) if sum(forward_bytes(model, (s, s), None, explicit)) > budget)
            raise MemoryPlanError(f"resolution {hw[0]}x{hw[1]} needs about {gib(shared + each)} for one image in {source} "
                                  f"({_tokens(model, hw, patch):,} tokens) and {device} has {gib(2 * budget)} available; "
                                  f"use sizes up to about {side - model.patch_size}x{side - model.patch_size}")
        out[hw] = max(1, min(batch_size, (budget - shared) // each))
        if out[hw] < batch_size:
            shrunk.append(f"{hw[0]}x{hw[1]}: {out[hw]}")
        if train_size is not None:
            work = (_tokens(model, hw, patch) / _tokens(model, train_size, None)) ** 2
            if work >= 100:
                slow.append(f"{hw[0]}x{hw[1]} has {_tokens(model, hw, patch):,} tokens per image: {work:,.0f}x the attention work")
    if shrunk:
        print(f"note: {source}: images per batch lowered to fit memory at {'; '.join(shrunk)}", file=sys.stderr)
    if slow:
        print(f"note: {source}: {'; '.join(slow)} of the training size {train_size[0]}x{train_size[1]} "
              f"({_tokens(model, train_size, None):,} tokens), and about as much more time per image", file=sys.stderr)
    return out


def seed_step(*parts: int) -> None:
    """Seed every generator from a tuple such as (seed, epoch, step): each step's randomness is then a
    function of where it is in the run, not of what ran before, so a resumed run repeats it exactly."""
    s = 0
    for p in parts:
        s = (s * 1_000_003 + int(p) + 1) % (2**31 - 1)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


class Heartbeat:
    """Progress lines for logs: where no progress bar shows (output to a file or a pipe: every cluster job, every
    ``nohup``), at most one line every ``every`` seconds with the rate and the time left."""

    def __init__(self, desc: str, total: int, every: float = 60.0, log: Callable[[str], None] = print, enabled: bool = True) -> None:
        self.desc, self.total, self.every, self.log, self.enabled = desc, total, every, log, enabled
        self.start = self.last = time.time()

    def tick(self, done: int, extra: str = "") -> None:
        now = time.time()
        if not self.enabled or now - self.last < self.every or done <= 0:
            return
        self.last = now
        rate = done / (now - self.start)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        self.log(f"{self.desc}: {done}/{self.total} ({100 * done / max(self.total, 1):.0f}%), {now - self.start:.0f}s, "
                 f"about {left:.0f}s left{extra}")


def progress_steps(total: int, step: int, desc: str, progress: bool) -> Iterator[int]:
    """``range(0, total, step)``, shown while it runs when ``progress``: a bar on a terminal, else a line every 30 s."""
    from tqdm import tqdm

    bar = progress and sys.stderr.isatty()
    beat = Heartbeat(desc, total, every=30.0, enabled=progress and not bar)
    for s in tqdm(range(0, total, step), desc=desc, leave=False, disable=not bar):
        yield s
        beat.tick(min(s + step, total))
