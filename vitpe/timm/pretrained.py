"""timm's file layout for vitpe models: a folder with ``config.json`` (the architecture timm knows it by, and the model's
arguments) and ``model.safetensors`` (its weights), which :func:`from_pretrained` and timm both load:

    vitpe.save_pretrained(model, "my-vit")
    model = vitpe.from_pretrained("my-vit")
    model = timm.create_model("vitpe_vit", pretrained=True, pretrained_cfg_overlay=dict(file="my-vit/model.safetensors"),
                              **json.load(open("my-vit/config.json"))["model_args"])
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from ..checkpoint import CHECKPOINT_NAME, CheckpointError, build_model, load_model_state, non_finite, shipped_cfg
from ..vit import VisionTransformer
from .models import GENERIC as ARCHITECTURE  # the timm name of a vitpe ViT built from its model_args

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "WEIGHTS_FILE", "save_pretrained", "from_pretrained", "preprocessing", "is_exported", "exported_run"]

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
DATA_KEY = "vitpe_data"  # config.json's record of the data a run trained on (name, data_dir, test_size): eval.py's default


def _json_args(model: VisionTransformer) -> Dict[str, Any]:
    args = dict(model.model_args, coord_mode=str(model.coord_mode))
    try:
        return json.loads(json.dumps(args))  # tuples become lists, which the model takes back
    except TypeError as e:
        raise ValueError(f"this model's arguments cannot be written as JSON ({e}); build it from plain values") from None


def save_pretrained(model: VisionTransformer, directory: Union[str, Path], overwrite: bool = False, *,
                    mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                    label_names: Optional[Sequence[str]] = None) -> Path:
    """Write ``model`` in timm's layout: ``DIR/config.json`` (``architecture``, ``num_classes``, ``num_features``,
    ``model_args``, ``pretrained_cfg``, ``label_names``, ``weights_sha256``) and ``DIR/model.safetensors``.

    ``pretrained_cfg`` says how images must be prepared (input size, bicubic resize, ``mean``/``std``) and
    ``label_names`` what the head predicts: by default what the model carries (a model read from a run carries its
    run's, see :func:`vitpe.checkpoint.model_from_checkpoint`), else the arguments; without either, timm's 0.5
    normalization and no names. Each file is written whole or not at all; an existing one is kept unless
    ``overwrite=True``. Returns the folder."""
    from safetensors.torch import save_file

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"save_pretrained takes a vitpe.VisionTransformer, got {type(model).__name__}")
    out = Path(directory)
    present = [n for n in (CONFIG_FILE, WEIGHTS_FILE) if (out / n).exists()]
    if present and not overwrite:
        raise FileExistsError(f"{out / present[0]} exists; choose another folder or pass overwrite=True")
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    bad = non_finite(state)
    if bad:
        raise ValueError(f"the model holds non-finite weights ({bad[0]}): nothing was written")
    args = _json_args(model)
    cfg = preprocessing(model, mean, std, label_names)
    config = {"architecture": ARCHITECTURE, "num_classes": model.num_classes, "num_features": model.embed_dim, "model_args": args,
              "pretrained_cfg": {k: v for k, v in cfg.items() if k != "label_names"},
              **({"label_names": cfg["label_names"]} if "label_names" in cfg else {}),
              **({DATA_KEY: dict(model.vitpe_data)} if getattr(model, "vitpe_data", None) else {})}
    out.mkdir(parents=True, exist_ok=True)
    mode = 0o666 & ~_umask()  # safetensors writes 0600; the folder's files are as readable as any the user writes
    tmp = out / f".{WEIGHTS_FILE}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, mode)
    config["weights_sha256"] = file_sha256(tmp)
    os.replace(tmp, out / WEIGHTS_FILE)
    tmp = out / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(tmp, mode)
    os.replace(tmp, out / CONFIG_FILE)
    return out


def preprocessing(model: VisionTransformer, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None,
                  label_names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """timm's ``pretrained_cfg`` (with ``label_names``) that ships with ``model``: what it carries, the arguments given
    over it, the input size always its own. A wrong length is a ``ValueError`` line."""
    cfg = shipped_cfg(model)
    carried = getattr(model, "pretrained_cfg", None) or {}
    cfg.update({k: list(carried[k]) if isinstance(carried[k], (list, tuple)) else carried[k]
                for k in ("mean", "std", "interpolation", "crop_pct", "label_names") if carried.get(k) is not None})
    for key, value, n in (("mean", mean, model.in_chans), ("std", std, model.in_chans), ("label_names", label_names, model.num_classes)):
        if value is not None:
            if len(value) != n:
                raise ValueError(f"{key} has {len(value)} values and the model has {n} {'classes' if key == 'label_names' else 'input channels'}")
            cfg[key] = [str(v) for v in value] if key == "label_names" else [float(v) for v in value]
    if len(cfg.get("label_names", [])) != model.num_classes:  # names of another head (reset_classifier since)
        cfg.pop("label_names", None)
    return cfg


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_sha256(path: Union[str, Path]) -> str:
    """The SHA-256 of a file's bytes, read a megabyte at a time (the weights a folder or a fine-tune records)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def from_pretrained(directory: Union[str, Path], map_location: Any = "cpu") -> VisionTransformer:
    """The model :func:`save_pretrained` wrote into ``directory``, in eval mode. A missing, unreadable or mismatched file
    is one ``CheckpointError`` line saying which and why."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / name).is_file():
            raise CheckpointError(f"{d / name} does not exist: give the folder vitpe.save_pretrained wrote")
    try:
        config = json.loads((d / CONFIG_FILE).read_text())
        args = config["model_args"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        raise CheckpointError(f"{d / CONFIG_FILE} is not a vitpe model config ({type(e).__name__}: {str(e)[:120]}); write it "
                              "with vitpe.save_pretrained") from None
    if config.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{d / CONFIG_FILE} describes a {config.get('architecture')!r}, not a vitpe ViT ({ARCHITECTURE!r}); "
                              "load it with timm.create_model")
    try:
        state = load_file(str(d / WEIGHTS_FILE), device=str(map_location) if map_location is not None else "cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{d / WEIGHTS_FILE} is not a readable safetensors file ({str(e)[:120]}); it may be truncated: write it again") from None
    recorded = config.get("weights_sha256")
    if recorded is not None and file_sha256(d / WEIGHTS_FILE) != recorded:
        raise CheckpointError(f"{d / WEIGHTS_FILE} is not the file {CONFIG_FILE} was written with (its sha256 differs from the "
                              f"recorded {str(recorded)[:12]}...): it was changed or damaged; export the model again")
    model = build_model(args, state, str(d / CONFIG_FILE), "; a newer vitpe may have written it")
    bad = non_finite(state)
    if bad:
        raise CheckpointError(f"{d / WEIGHTS_FILE} holds non-finite weights ({bad[0]})")
    load_model_state(model, state, str(d / WEIGHTS_FILE))
    shipped = config.get("pretrained_cfg") if isinstance(config.get("pretrained_cfg"), dict) else {}
    model.pretrained_cfg = dict(shipped, **({"label_names": config["label_names"]} if config.get("label_names") else {}))
    model.vitpe_data = config.get(DATA_KEY) if isinstance(config.get(DATA_KEY), dict) else {}
    return model.to(map_location).eval()


def is_exported(path: Union[str, Path]) -> bool:
    """Whether ``path`` is a folder :func:`save_pretrained` wrote (a ``config.json``, no run checkpoint)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and not (p / CHECKPOINT_NAME).exists()


def exported_run(directory: Union[str, Path]) -> Tuple[VisionTransformer, Dict[str, Any]]:
    """A folder :func:`save_pretrained` wrote, read as ``eval.py`` and ``predict`` read a run: the model, and a state
    shaped as a checkpoint's: ``config`` (the model's settings, and under ``data`` the dataset its run trained on where
    the folder records it), ``data`` (``classes``: ``label_names`` or the head's row numbers, ``mean``, ``std``,
    ``in_chans``), no EMA."""
    import dataclasses

    from ..config import ModelConfig

    model = from_pretrained(directory)
    cfg, names = model.pretrained_cfg, {f.name for f in dataclasses.fields(ModelConfig)}
    settings = {k: v for k, v in _json_args(model).items() if k in names}
    h, w = model.img_size
    settings["img_size"] = h if h == w else [h, w]
    classes = cfg.get("label_names") or [str(i) for i in range(model.num_classes)]
    return model, {"config": {"model": settings, "data": dict(model.vitpe_data)}, "ema": None, "model_args": model.model_args,
                   "data": {"classes": list(classes), "mean": cfg["mean"], "std": cfg["std"], "in_chans": model.in_chans}}
