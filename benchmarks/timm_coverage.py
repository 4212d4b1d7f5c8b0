"""Which of timm's ViTs ``vitpe.vit_from_timm`` converts, and how exactly: every tiny/small/base model of the ViT families
(``vit_*``, ``deit*``, ``eva*``, ``naflexvit*``, ``flexivit*``), created with ``pretrained=False`` and its weights
perturbed (so that LayerScale, zero-initialised heads and latents all count), converted, and compared with timm on the
same input: tokens (``forward_features``) and output (``forward_head``) at the model's own size, and the output at a
larger, non-square size against timm's own dynamic-size path (``dynamic_img_size=True``). A model vitpe refuses is
listed with the one-line reason vitpe gives.

    python -m benchmarks.timm_coverage                       # every model (about 10 minutes on 2 cores)
    python -m benchmarks.timm_coverage --models deit eva02   # those whose name contains a pattern
    python -m benchmarks.timm_coverage --report              # the summary from the record

Record: docs/timm/coverage.csv (one row a model); docs/timm.md reads its counts.
"""
from __future__ import annotations

import argparse
import csv
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, List

import torch

import vitpe
from vitpe.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[1]

RECORD = ROOT / "docs" / "timm" / "coverage.csv"
FAMILIES = ("vit_*", "deit*", "eva*", "naflexvit*", "flexivit*")
SIZES = re.compile(r"(tiny|small|base)")
TOLERANCE = 1e-4  # relative: max |vitpe - timm| / max |timm|
COLUMNS = ("model", "timm_class", "status", "pos_embed", "tokens_error", "output_error", "new_size", "new_size_error", "reason")


def timm_models() -> List[str]:
    """The models the coverage counts: timm's tiny/small/base ViT-family models."""
    import timm

    return sorted({n for pattern in FAMILIES for n in timm.list_models(pattern) if SIZES.search(n)})


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-12))


def measure(name: str, seed: int = 0) -> Dict[str, object]:
    """One model's row: converted or refused, and how far vitpe's outputs are from timm's."""
    import timm

    try:
        m = timm.create_model(name, pretrained=False, dynamic_img_size=True)
    except TypeError:  # a model without timm's dynamic-size path
        m = timm.create_model(name, pretrained=False)
    m.eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    row: Dict[str, object] = {"model": name, "timm_class": type(m).__name__}
    try:
        ours = vitpe.vit_from_timm(m)
    except (ValueError, CheckpointError) as e:
        return {**row, "status": "refused", "reason": str(e)}
    # the model's own size: its patch grid's, or (NaFlexVit, whose table has its own grid) its default input's
    h, w = m.patch_embed.img_size if hasattr(m, "patch_embed") else m.pretrained_cfg["input_size"][1:]
    p = ours.patch_size
    x = torch.randn(2, ours.patch_embed.in_channels, h, w, generator=g)
    with torch.no_grad():
        a, b = m.forward_features(x), ours.forward_features(x)
        row.update(pos_embed=ours.pos_embed.name, tokens_error=relative_error(b, a), output_error=relative_error(ours.forward_head(b), m.forward_head(a)))
        size = (h + 2 * p, w + 4 * p)
        row["new_size"] = f"{size[0]}x{size[1]}"
        x = torch.randn(1, x.shape[1], *size, generator=g)
        try:
            row["new_size_error"] = relative_error(ours(x), m(x))
        except Exception as e:  # timm's own model cannot run there: vitpe's number stands alone
            row["new_size_error"] = ""
            row["reason"] = f"timm runs only at {h}x{w}: {str(e).splitlines()[0][:80]}"
    exact = row["tokens_error"] <= TOLERANCE and row["output_error"] <= TOLERANCE
    row["status"] = "converted" if exact else "differs"
    return row


def read_record() -> Dict[str, Dict[str, str]]:
    if not RECORD.exists():
        return {}
    with RECORD.open() as f:
        return {r["model"]: r for r in csv.DictReader(f)}


def write_record(rows: Dict[str, Dict[str, object]]) -> None:
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    tmp = RECORD.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS)
        out.writeheader()
        for name in sorted(rows):
            r = rows[name]
            out.writerow({k: (f"{r[k]:.1e}" if isinstance(r.get(k), float) else r.get(k, "")) for k in COLUMNS})
    tmp.replace(RECORD)


def summary(rows: Dict[str, Dict[str, object]]) -> str:
    """The counts docs/timm.md states, and each refusal's reason with its models."""
    status = Counter(r["status"] for r in rows.values())
    n = len(rows)
    lines = [f"{status['converted']} of {n} timm ViT-family models convert ({100 * status['converted'] / n:.0f}%), equal to timm "
             f"within {TOLERANCE:g} at their own size; {status['differs']} differ; {status['refused']} refused."]
    new = [r for r in rows.values() if r["status"] == "converted" and r.get("new_size_error") not in ("", None)]
    worst = max((float(r["new_size_error"]) for r in new), default=0.0)
    one_size = status["converted"] - len(new)
    lines.append(f"At a larger non-square size, {sum(float(r['new_size_error']) <= TOLERANCE for r in new)} of {len(new)} equal timm's "
                 f"dynamic-size path within {TOLERANCE:g} (largest difference {worst:.1e})"
                 + (f"; the other {one_size} run at one size in timm, at any in vitpe." if one_size else "."))
    reasons: Dict[str, List[str]] = {}
    for r in rows.values():
        if r["status"] == "refused":
            reasons.setdefault(str(r["reason"]), []).append(str(r["model"]))
    for reason, models in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {len(models)} refused: {reason} ({', '.join(models)})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help="only models whose name contains one of these")
    ap.add_argument("--report", action="store_true", help="print the summary of the record and stop")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows: Dict[str, Dict[str, object]] = dict(read_record())
    if not args.report:
        names = [n for n in timm_models() if not args.models or any(p in n for p in args.models)]
        for i, name in enumerate(names, 1):
            rows[name] = measure(name)
            r = rows[name]
            print(f"[{i}/{len(names)}] {name}: {r['status']} {r.get('output_error', '')} {r.get('reason', '')}"[:200], flush=True)
            write_record(rows)  # as each model finishes: an interrupted run keeps what it measured
        rows = dict(read_record())
    print(summary(rows))


if __name__ == "__main__":
    main()
