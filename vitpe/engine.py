"""Pieces train.py and eval.py share: devices, mixed precision, per-step seeding, evaluation."""
from __future__ import annotations

import contextlib
import random
from typing import Dict, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data.augment import normalize

__all__ = ["resolve_device", "amp_dtype", "autocast", "seed_step", "evaluate"]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use device=cpu or auto")
    return dev


AMP_MODES = ("auto", "bf16", "fp16", "none")


def amp_dtype(amp: str, device: torch.device) -> Optional[torch.dtype]:
    """auto: bf16 on CUDA; on CPU off, since without native bf16 matmuls it is slower, not faster."""
    if amp == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if amp == "fp16" and device.type != "cuda":
        raise ValueError("amp=fp16 needs a CUDA device; use bf16 or none on CPU")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def autocast(device: torch.device, dtype: Optional[torch.dtype]):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def seed_step(*parts: int) -> None:
    """Seed every generator from a tuple such as (seed, epoch, step): each step's randomness is then a
    function of where it is in the run, not of what ran before, so a resumed run repeats it exactly."""
    s = 0
    for p in parts:
        s = (s * 1_000_003 + int(p) + 1) % (2**31 - 1)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    batch_size: int = 512,
    device: torch.device = torch.device("cpu"),
    dtype: Optional[torch.dtype] = None,
    progress: bool = False,
    desc: str = "eval",
    patch_size: Optional[int] = None,
) -> Dict[str, float]:
    """Top-1, top-5 (when there are more than 5 classes), mean cross-entropy and per-class top-1 over a split.

    ``images`` are uint8, already at the size to evaluate; ``patch_size`` runs a vitpe ViT with a resized patch embedding (FlexiViT).
    """
    from tqdm import tqdm

    was_training = model.training
    model.eval()
    n, loss, top1, top5 = 0, 0.0, 0, 0
    hits = seen = None  # per-class counts
    batches = range(0, len(labels), batch_size)
    for s in tqdm(batches, desc=desc, leave=False, disable=not progress):
        x = images[s : s + batch_size]
        x = normalize(x.to(device, non_blocking=True), mean, std)
        y = labels[s : s + batch_size].to(device)
        with autocast(device, dtype):
            logits = model(x) if patch_size is None else model(x, patch_size=patch_size)
        logits = logits.float()
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        k = min(5, logits.shape[1])
        topk = logits.topk(k, dim=1).indices
        top1 += (topk[:, 0] == y).sum().item()
        top5 += (topk == y[:, None]).any(1).sum().item()
        c = logits.shape[1]
        h = torch.bincount(y[topk[:, 0] == y], minlength=c).cpu()
        t = torch.bincount(y, minlength=c).cpu()
        hits, seen = (h, t) if hits is None else (hits + h, seen + t)
        n += len(y)
    model.train(was_training)
    out = {"top1": top1 / max(n, 1), "loss": loss / max(n, 1), "n": n}
    if logits.shape[1] > 5:
        out["top5"] = top5 / max(n, 1)
    out["per_class_top1"] = (hits / seen.clamp_min(1)).tolist()
    return out
