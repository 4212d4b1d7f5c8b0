"""timm's file layout for vitpe models: a folder with ``config.json`` (the architecture timm knows it by, and the model's
arguments) and ``model.safetensors`` (its weights), which :func:`from_pretrained` and timm both load:

    vitpe.save_pretrained(model, "my-vit")
    model = vitpe.from_pretrained("my-vit")
    model = timm.create_model("vitpe_vit", pretrained=True, pretrained_cfg_overlay=dict(file="my-vit/model.safetensors"),
                              **json.load(open("my-vit/config.json"))["model_args"])
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Union

from .checkpoint import CheckpointError, load_model_state, non_finite
from .timm_models import GENERIC as ARCHITECTURE  # the timm name of a vitpe ViT built from its model_args
from .vit import VisionTransformer

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "WEIGHTS_FILE", "save_pretrained", "from_pretrained"]

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def _json_args(model: VisionTransformer) -> Dict[str, Any]:
    args = dict(model.model_args, coord_mode=str(model.coord_mode))
    try:
        return json.loads(json.dumps(args))  # tuples become lists, which the model takes back
    except TypeError as e:
        raise ValueError(f"this model's arguments cannot be written as JSON ({e}); build it from plain values") from None


def save_pretrained(model: VisionTransformer, directory: Union[str, Path], overwrite: bool = False) -> Path:
    """Write ``model`` in timm's layout: ``DIR/config.json`` (``architecture``, ``num_classes``, ``num_features``,
    ``model_args``, ``pretrained_cfg``) and ``DIR/model.safetensors``. Each file is written whole or not at all; an
    existing one is kept unless ``overwrite=True``. Returns the folder."""
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
    config = {
        "architecture": ARCHITECTURE, "num_classes": model.num_classes, "num_features": model.embed_dim, "model_args": args,
        "pretrained_cfg": {"input_size": [model.in_chans, *model.img_size], "crop_pct": 1.0, "interpolation": "bicubic",
                           "mean": [0.5] * model.in_chans, "std": [0.5] * model.in_chans, "first_conv": "patch_embed", "classifier": None},
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_FILE}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_FILE)
    tmp = out / f".{CONFIG_FILE}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / CONFIG_FILE)
    return out


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
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{d / CONFIG_FILE} is not a vitpe model config ({type(e).__name__}: {e}); write it with vitpe.save_pretrained") from None
    if config.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{d / CONFIG_FILE} describes a {config.get('architecture')!r}, not a vitpe ViT ({ARCHITECTURE!r}); "
                              "load it with timm.create_model")
    try:
        model = VisionTransformer(**args)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d / CONFIG_FILE}'s model_args do not build a vitpe ViT ({e}); a newer vitpe may have written it") from None
    try:
        state = load_file(str(d / WEIGHTS_FILE), device=str(map_location) if map_location is not None else "cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{d / WEIGHTS_FILE} is not a readable safetensors file ({str(e)[:120]}); it may be truncated: write it again") from None
    bad = non_finite(state)
    if bad:
        raise CheckpointError(f"{d / WEIGHTS_FILE} holds non-finite weights ({bad[0]})")
    load_model_state(model, state, str(d / WEIGHTS_FILE))
    return model.to(map_location).eval()
