"""Checkpoints that never lose work: atomic writes, and loading that says exactly what is wrong."""
from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .errors import VitpeError
from .runs import remove_stale
from .vit import VisionTransformer, parameter_estimate

__all__ = [
    "CheckpointError", "FORMAT", "save_checkpoint", "load_checkpoint", "find_checkpoint", "model_from_checkpoint",
    "state_checksum", "non_finite", "checkpoint_config", "check_classes",
]

FORMAT = "vitpe-checkpoint-v1"
CHECKPOINT_NAME = "checkpoint.pt"


class CheckpointError(VitpeError, RuntimeError):
    """A checkpoint that is missing, truncated, foreign or from an incompatible model."""


def _tensors(obj: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Every leaf of a nested state, in a fixed order, with its path."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def state_checksum(state: Dict[str, Any]) -> str:
    """SHA-256 of every tensor (dtype, shape, bytes) and value in ``state``, except its ``checksum`` and ``format``."""
    h = hashlib.sha256()
    for path, leaf in _tensors({k: v for k, v in state.items() if k not in ("checksum", "format")}):
        h.update(path.encode())
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def non_finite(state_dict: Dict[str, torch.Tensor]) -> list:
    """Names of the floating-point tensors in ``state_dict`` that hold a NaN or an infinity."""
    return [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]


def save_checkpoint(state: Dict[str, Any], path: Union[str, Path]) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file in the same directory, flushed to disk,
    then renamed over the old one. A kill at any moment leaves either the old or the new checkpoint.
    A checksum of the whole state goes with it, and temporaries left by killed writes are removed."""
    path = Path(path)
    prefix = f".{path.name}.tmp"
    remove_stale(path.parent, prefix)
    tmp = path.parent / f"{prefix}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save({"format": FORMAT, **state, "checksum": state_checksum(state)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def find_checkpoint(path: Union[str, Path]) -> Path:
    """A run directory or a checkpoint file -> the checkpoint file."""
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
        if not p.is_file():
            raise CheckpointError(f"no {CHECKPOINT_NAME} in run directory {path}; it has not finished a first epoch, or it is not a vitpe run")
    elif not p.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give a run directory (runs/NAME) or a .pt file")
    return p


def load_checkpoint(path: Union[str, Path], map_location: Any = "cpu", verify: bool = True) -> Dict[str, Any]:
    """Load and validate a vitpe checkpoint (a run directory or file); ``verify`` checks the stored checksum
    (checkpoints written before checksums existed load without one)."""
    p = find_checkpoint(path)
    with open(p, "rb") as f:
        head = f.read(4)
    if not head:
        raise CheckpointError(f"checkpoint {p} is empty (a write cut short); resume from an earlier copy or retrain")
    if head != b"PK\x03\x04":  # torch.save writes a zip archive; anything else was never a checkpoint
        kind = "a text file" if all(32 <= b < 127 or b in (9, 10, 13) for b in head) else "a binary file"
        raise CheckpointError(f"{p} is not a vitpe checkpoint: it is {kind} (starts {head!r}), not the zip archive torch.save "
                              "writes; give a run directory or its checkpoint.pt")
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError, KeyError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(f"checkpoint {p} is truncated or corrupt ({reason}); resume from an earlier copy or retrain") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{p} is not a vitpe checkpoint (no '{FORMAT}' marker); vitpe reads the checkpoints its train.py writes")
    for key in ("model", "model_args", "config"):
        if key not in state:
            raise CheckpointError(f"checkpoint {p} lacks '{key}'; it was not written by vitpe's train.py")
    if verify and "checksum" in state and state_checksum(state) != state["checksum"]:
        raise CheckpointError(
            f"checkpoint {p} is corrupt: its contents do not match the checksum saved with them (changed on disk); "
            "resume from an earlier copy, or pass --no-verify to load it anyway"
        )
    return state


def state_mismatches(own: Dict[str, torch.Tensor], given: Dict[str, torch.Tensor]) -> Tuple[List[str], List[str], List[str]]:
    """How ``given`` fails to fit a model whose state dict is ``own``: the names it lacks, the names it has beyond, and
    ``"name (given shape) vs (own shape)"`` for the tensors of another shape; three empty lists when it fits."""
    missing = [k for k in own if k not in given]
    unexpected = [k for k in given if k not in own]
    shapes = [f"{k} {tuple(given[k].shape)} vs {tuple(v.shape)}" for k, v in own.items() if k in given and given[k].shape != v.shape]
    return missing, unexpected, shapes


def load_model_state(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` with one readable line instead of a wall of key names."""
    missing, unexpected, shapes = state_mismatches(model.state_dict(), state_dict)
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]})")
        if shapes:
            parts.append(f"{len(shapes)} with other shapes (e.g. {shapes[0]})")
        raise CheckpointError(f"checkpoint {source} does not fit this model: {'; '.join(parts)}; build the model from the checkpoint's own config")
    model.load_state_dict(state_dict)


def checkpoint_config(state: Dict[str, Any]):
    """The run's typed :class:`vitpe.config.Config` from a loaded checkpoint (keys added since it was written
    take their defaults)."""
    from .config import ConfigError, config_from_dict

    try:
        return config_from_dict(state["config"])
    except ConfigError as e:
        raise CheckpointError(f"the checkpoint's config is not one this vitpe reads ({e})") from None


def shipped_cfg(model: VisionTransformer, data: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """timm's ``pretrained_cfg`` of ``model`` trained on ``data`` (a run's dataset description): the input size, resize
    interpolation and normalization its images need, and (timm's ``label_names``) the classes its head predicts. timm's
    data config (``timm.data.resolve_data_config``) reads it; without ``data`` the normalization is timm's 0.5 default."""
    chans = model.in_chans
    cfg: Dict[str, Any] = {"input_size": [chans, *model.img_size], "crop_pct": 1.0, "interpolation": "bicubic",  # vitpe's resize
                           "mean": [0.5] * chans, "std": [0.5] * chans, "first_conv": "patch_embed", "classifier": None}
    if data is not None:
        cfg.update(mean=[float(v) for v in data["mean"]], std=[float(v) for v in data["std"]])
        if data.get("classes") and len(data["classes"]) == model.num_classes:
            cfg["label_names"] = [str(c) for c in data["classes"]]
    return cfg


def build_model(args: Any, weights: Dict[str, Any], where: str, hint: str = "") -> VisionTransformer:
    """``VisionTransformer(**args)`` for the tensors ``weights``: arguments that are not a model's (a wrong type, a range
    such as ``num_heads: 0`` or ``norm_eps: -1``) are one ``CheckpointError`` line naming ``where``, and so are arguments
    that describe a model far larger than its weights (a damaged config, ``embed_dim: 1e9``): refused before anything
    is allocated. ``hint`` ends the line."""
    if not isinstance(args, dict):
        raise CheckpointError(f"{where} holds no model arguments (a {type(args).__name__}, not a mapping){hint}")
    held = sum(t.numel() for t in weights.values() if isinstance(t, torch.Tensor)) if isinstance(weights, dict) else 0
    try:
        wanted = parameter_estimate(args)
    except (TypeError, ValueError, OverflowError):  # a value of the wrong type: the constructor's own line says which
        wanted = 0
    if wanted > 2 * held + 1_000_000:
        raise CheckpointError(f"{where} describes a model of about {wanted:,} parameters, but its weights hold {held:,}: "
                              f"its model arguments were changed or damaged{hint}")
    try:
        return VisionTransformer(**args)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} describes a model this vitpe cannot build ({str(e).splitlines()[0][:200]}){hint}") from None


def model_from_checkpoint(
    path: Union[str, Path], map_location: Any = "cpu", ema: bool = True, verify: bool = True
) -> Tuple[VisionTransformer, Dict[str, Any]]:
    """Rebuild the model from the checkpoint alone (its architecture travels with it); EMA weights if present."""
    state = load_checkpoint(path, map_location, verify)
    weights = state["ema"] if ema and state.get("ema") is not None else state["model"]
    model = build_model(state["model_args"], weights, f"checkpoint {path}")
    load_model_state(model, weights, str(path))
    model.pretrained_cfg = shipped_cfg(model, state.get("data"))  # what save_pretrained and export write with it
    data = (state.get("config") or {}).get("data") or {}
    model.vitpe_data = {k: data[k] for k in ("name", "data_dir", "test_size") if data.get(k) is not None}  # what eval.py reads
    return model.eval(), state


def class_mismatch(trained: List[str], given: List[str]) -> Optional[str]:
    """How the class names ``given`` differ from those a model was ``trained`` on (the order is the head's rows), in a few
    words; None when they are the same."""
    if list(trained) == list(given):
        return None
    gone, new = [c for c in trained if c not in given], [c for c in given if c not in trained]
    if not gone and not new:
        return f"the same {len(trained)} names in another order ({', '.join(given[:4])}{', ...' if len(given) > 4 else ''})"
    show = lambda names: ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")  # noqa: E731
    parts = ([f"{show(gone)} no longer there"] if gone else []) + ([f"{show(new)} new"] if new else [])
    return "; ".join(parts)


def check_classes(state: Dict[str, Any], ds, source: str, fix: str) -> List[str]:
    """Refuse a dataset whose class names are not those the checkpoint's head was trained on (:class:`CheckpointError`
    naming the difference, then ``fix``); checkpoints record their classes by name. Returns notes: the training images
    changed since the checkpoint (an image folder's fingerprint), or the checkpoint predates class names."""
    data = state.get("data") or {}
    trained = data.get("classes")
    if trained is None:
        return [f"{source} records no class names (written by an older vitpe): only the class count ({ds.num_classes}) could be checked"]
    diff = class_mismatch(trained, list(ds.classes))
    if diff:
        raise CheckpointError(f"{source} was trained on classes {', '.join(trained[:6])}{', ...' if len(trained) > 6 else ''} "
                              f"but {ds.name} has other classes ({diff}): each output of the model means one of its own classes; {fix}")
    old, new = data.get("fingerprint"), getattr(ds, "fingerprint", None)
    same_kind = old and new and old.startswith("files:") == new.startswith("files:")  # a folder read by bytes or by pixels
    if same_kind and old != new:
        return [f"the training images of {ds.name} changed since {source} was written (same classes, other images)"]
    return []
