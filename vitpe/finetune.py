"""Start from a model you have: a vitpe run or checkpoint, a ``save_pretrained`` folder (vitpe's or timm's layout), or a
timm model (``timm:NAME``, its weights from a file), fine-tuned to new data, new classes, a new size or another PE.

    model = vitpe.init_from("runs/A", classes=my_classes, img_size=64)            # your own loop
    python train.py --init runs/A --set model.img_size=64                        # the same, as a run

The source gives the architecture; what fine-tuning may change (:data:`FINE_TUNABLE`) adapts: a new ``img_size`` or
``patch_size`` gives the PE a new reference grid, and each family resamples what is laid on the grid
(:meth:`vitpe.PosEmbed.resampled_state`: learned tables as timm's ``resample_abs_pos_embed``, relative-bias tables as
Swin/BEiT), the patch kernel is resized as FlexiViT does, another PE family starts fresh. The head is kept for the same
classes (rows reordered to the new order), new for others, as timm's ``reset_classifier``. The source is only read.
"""
from __future__ import annotations

import json
import pickle
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .checkpoint import CHECKPOINT_NAME, CheckpointError, build_model, class_mismatch, load_checkpoint, state_mismatches
from .config import frozen_spec
from .coords import to_2tuple
from .errors import VitpeError
from .patch import resize_patch_embed
from .suggest import did_you_mean
from .timm.pretrained import ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE, file_sha256
from .vit import VisionTransformer

__all__ = ["InitError", "Source", "FINE_TUNABLE", "read_source", "source_model_args", "start_model", "freeze", "frozen_spec", "init_from"]

# Model arguments a fine-tune may change; every other one is the source's architecture.
FINE_TUNABLE = ("img_size", "patch_size", "pos_embed", "pos_embed_kwargs", "coord_mode", "coord_aug", "drop_rate", "attn_drop_rate",
                "drop_path_rate", "content_keep")
_HEADS = ("head.", "head_dist.")


class InitError(VitpeError):
    """A source to start from that cannot be used as given (missing, not weights, unknown name, shapes that do not fit)."""

    exit_code = 2


@dataclass
class Source:
    """A model to start from, as read: its ``model_args`` (:class:`VisionTransformer`'s), its weights in vitpe's names,
    the class names its head predicts (None where the source records none), the data a vitpe run trained on, and where
    it came from (``provenance``: ``source``, ``weights`` file, its ``sha256``)."""

    spec: str
    model_args: Dict[str, Any]
    state: Dict[str, Tensor]
    classes: Optional[List[str]]
    provenance: Dict[str, str]
    data: Optional[Dict[str, Any]] = None
    notes: List[str] = field(default_factory=list)

    @property
    def describe(self) -> str:
        a = self.model_args
        return (f"ViT {a['embed_dim']} wide, {a['depth']} blocks, {a['num_heads']} heads, patch {a['patch_size']}, "
                f"{_size(a['img_size'])} px, pe {a['pos_embed']}")


def _size(img_size: Any) -> str:
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    return str(h) if h == w else f"{h}x{w}"


def read_weights(path: Union[str, Path]) -> Dict[str, Tensor]:
    """A state dict from ``.safetensors``, or from a ``.pth``/``.pt``/``.bin`` file read without executing code
    (``torch.load(weights_only=True)``); common wrappers (``state_dict``, ``model``, ``module.``) are unwrapped."""
    p = Path(path)
    if not p.is_file():
        raise InitError(f"weights file {path} does not exist")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd: Any = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError, KeyError, AttributeError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise InitError(f"{path} is not a weights file vitpe can read ({why}); give a .safetensors file or a .pth/.bin state dict") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, Tensor) for v in sd.values()):
        raise InitError(f"{path} holds no state dict (a mapping of names to tensors); give the model's weights")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def _first_mismatches(own: Dict[str, Tensor], sd: Dict[str, Tensor], n: int = 3) -> str:
    """The first ``n`` tensors of each kind by which ``sd`` does not fit the state dict ``own``, in one line ("" if it fits)."""
    missing, unexpected, shapes = state_mismatches(own, sd)
    parts = ([f"other shapes: {'; '.join(shapes[:n])}"] if shapes else []) + ([f"missing: {', '.join(missing[:n])}"] if missing else []) \
        + ([f"unexpected: {', '.join(unexpected[:n])}"] if unexpected else [])
    return ", ".join(parts)


# ---- reading a source --------------------------------------------------------------------------------------------
def _timm_model(name: str, weights: Optional[str], num_classes: Optional[int] = None, **model_args: Any) -> Tuple[nn.Module, Dict[str, str]]:
    """timm's ``name`` with the weights of ``weights`` (through timm's own checkpoint filter, which converts original
    layouts), or timm's pretrained weights where its hub is reachable."""
    import timm

    base = name.split(".", 1)[0]
    if base not in timm.list_models():
        raise InitError(f"timm has no model {name!r}{did_you_mean(base, timm.list_models(base.split('_')[0] + '*') or timm.list_models())}; "
                        "timm.list_models('vit_*') lists them")
    kwargs = dict(model_args, **({"num_classes": num_classes} if num_classes is not None else {}))
    if weights is None:
        try:
            model = timm.create_model(name, pretrained=True, **kwargs)
        except Exception as e:  # no network, no such tag, a hub error: all mean the same to the user
            raise InitError(f"could not get timm's pretrained weights for {name} ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}); "
                            "nothing is downloaded at run time here: give the file with --init-weights FILE") from None
        return model, {"weights": f"timm hub: {name}"}
    sd = read_weights(weights)
    model = timm.create_model(name, pretrained=False, **kwargs)
    filter_fn: Optional[Callable] = getattr(sys.modules.get(type(model).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            sd = filter_fn(sd, model)
        except Exception:  # a file in the model's own names needs no filter; the shape check below names what is wrong
            pass
    problems = _first_mismatches(model.state_dict(), sd)
    if problems:
        raise InitError(f"the weights in {weights} do not fit timm's {name} ({problems}); give the weights of that model")
    model.load_state_dict(sd)
    return model, {"weights": str(Path(weights).resolve()), "sha256": file_sha256(weights)}


def _from_timm(model: nn.Module, spec: str) -> VisionTransformer:
    from .timm.convert import vit_from_timm

    try:
        return vit_from_timm(model)
    except ValueError as e:
        raise InitError(f"{spec} is not a model vitpe converts ({e}); docs/timm.md lists those it does") from None


def _source(spec: str, model: VisionTransformer, classes: Optional[List[str]], provenance: Dict[str, str], **extra: Any) -> Source:
    args = dict(model.model_args, coord_mode=str(model.coord_mode))
    return Source(spec, args, {k: v.detach() for k, v in model.state_dict().items()}, classes, {"source": spec, **provenance}, **extra)


def _folder_source(spec: str, d: Path) -> Source:
    try:
        config = json.loads((d / CONFIG_FILE).read_text())
        arch = config["architecture"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise InitError(f"{d / CONFIG_FILE} is not a model config ({type(e).__name__}: {e}); give a folder save_pretrained wrote") from None
    labels = (config.get("pretrained_cfg") or {}).get("label_names") or config.get("label_names")
    classes = list(labels) if isinstance(labels, list) and labels else None
    files = [d / n for n in (WEIGHTS_FILE, "pytorch_model.bin", "model.pth") if (d / n).is_file()]
    if not files:
        raise InitError(f"{d} has a {CONFIG_FILE} but no weights ({WEIGHTS_FILE} or pytorch_model.bin)")
    if arch == ARCHITECTURE:
        from .timm.pretrained import from_pretrained

        try:
            model = from_pretrained(d)
        except CheckpointError as e:
            raise InitError(str(e)) from None
        return _source(spec, model, classes, {"weights": str(files[0].resolve()), "sha256": file_sha256(files[0])})
    timm_model, provenance = _timm_model(arch, str(files[0]), config.get("num_classes"), **(config.get("model_args") or {}))
    return _source(spec, _from_timm(timm_model, f"{d} ({arch})"), classes, provenance)


def read_source(spec: str, weights: Optional[str] = None) -> Source:
    """What ``spec`` names, read (never written): a vitpe run directory or its checkpoint (its EMA weights where it kept
    them, the ones its top-1 was measured on), a ``save_pretrained`` folder in vitpe's or timm's layout, or
    ``timm:NAME`` with ``weights`` a ``.safetensors``/``.pth``/``.bin`` file (without one, timm's hub). Any problem is
    one :class:`InitError` line."""
    if spec.startswith("timm:"):
        name = spec[len("timm:"):]
        model, provenance = _timm_model(name, weights)
        labels = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
        return _source(spec, _from_timm(model, spec), list(labels) if labels else None, provenance)
    if weights is not None:
        raise InitError(f"--init-weights goes with --init timm:NAME (the file's architecture); {spec} carries its own weights")
    p = Path(spec)
    if not p.exists():
        raise InitError(f"--init {spec}: no such file or folder; give a run directory, a checkpoint, a save_pretrained folder or timm:NAME")
    if p.is_file() and p.suffix in (".safetensors", ".pth", ".bin"):
        raise InitError(f"{spec} holds weights without an architecture: give --init timm:NAME --init-weights {spec}, or the folder it came from")
    if p.is_dir() and (p / CONFIG_FILE).is_file() and not (p / CHECKPOINT_NAME).exists():
        return _folder_source(spec, p)
    try:
        state = load_checkpoint(p)
    except CheckpointError as e:
        raise InitError(str(e)) from None
    ckpt = p / CHECKPOINT_NAME if p.is_dir() else p
    weights_state = state["ema"] if state.get("ema") is not None else state["model"]
    try:
        model = build_model(state["model_args"], weights_state, spec)
        model.load_state_dict(weights_state)
    except CheckpointError as e:
        raise InitError(str(e)) from None
    except RuntimeError as e:
        raise InitError(f"{spec} describes a model this vitpe cannot load ({str(e).splitlines()[0][:120]})") from None
    data = state.get("data") or {}
    notes = [f"weights: the EMA of {spec} (the ones its test top-1 was measured on)"] if state.get("ema") is not None else []
    return _source(spec, model, data.get("classes"), {"weights": str(ckpt.resolve()), "sha256": file_sha256(ckpt)},
                   data=(state.get("config") or {}).get("data"), notes=notes)


# ---- the architecture: the source's, with what fine-tuning may change ----------------------------------------
def source_model_args(source: Source, changes: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """The model a fine-tune builds: ``source``'s architecture with ``changes`` to :data:`FINE_TUNABLE` keys. A change to
    anything else that differs from the source raises :class:`InitError` naming the key; a change of PE family drops the
    source's PE options. Returns the arguments (without ``num_classes``/``in_chans``, which the data sets) and one line
    per change."""
    args = {k: v for k, v in source.model_args.items() if k not in ("num_classes", "in_chans")}
    notes = []
    for key, value in changes.items():
        if key not in args:
            raise InitError(f"model.{key} is not an argument of a vitpe ViT{did_you_mean(key, list(args))}")
        if key in FINE_TUNABLE:
            continue
        same = value == args[key] or (isinstance(value, (list, tuple)) and isinstance(args[key], (list, tuple)) and list(value) == list(args[key]))
        if not same:
            raise InitError(f"model.{key}={value!r} contradicts {source.spec}, whose {key} is {args[key]!r}: the architecture comes from "
                            f"the source; drop that setting (a fine-tune may change {', '.join('model.' + k for k in FINE_TUNABLE)})")
    if "pos_embed" in changes and changes["pos_embed"] != args["pos_embed"] and "pos_embed_kwargs" not in changes:
        changes = dict(changes, pos_embed_kwargs={})  # the source's options belong to its family
    for key in FINE_TUNABLE:
        if key in changes and changes[key] != args.get(key):
            notes.append(f"model.{key}: {args.get(key)!r} -> {changes[key]!r}")
            args[key] = changes[key]
    return args, notes


# ---- the model: the source's weights in the new architecture ------------------------------------------------------
def _pe_state(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return {k[len("pos_embed."):]: v for k, v in state.items() if k.startswith("pos_embed.")}


def start_model(source: Source, model_args: Dict[str, Any], classes: Optional[Sequence[str]] = None,
                num_classes: Optional[int] = None) -> Tuple[VisionTransformer, List[str]]:
    """A :class:`VisionTransformer` built from ``model_args`` (with ``num_classes``/``in_chans``) holding ``source``'s
    weights, adapted: the PE resampled to a new reference grid (or, for another family, its own initialisation), the
    patch kernel resized to a new patch size (FlexiViT) or summed to other input channels (timm's ``adapt_input_conv``),
    the head kept for the same classes and new for others. Returns the model and one line per adaptation."""
    classes = list(classes) if classes is not None else None
    n_out = len(classes) if classes is not None else num_classes if num_classes is not None else source.model_args.get("num_classes", 0)
    model = VisionTransformer(**dict(model_args, num_classes=n_out))
    old, new = source.state, model.state_dict()
    notes: List[str] = []
    body = {k: v for k, v in old.items() if not k.startswith(("pos_embed.",) + _HEADS)}
    weight = body.get("patch_embed.weight")
    if weight is not None and weight.shape[1] != model.in_chans:
        from timm.models import adapt_input_conv

        body["patch_embed.weight"] = adapt_input_conv(model.in_chans, weight)
        notes.append(f"patch embedding: {weight.shape[1]} input channels -> {model.in_chans} (timm's adapt_input_conv)")
    if weight is not None and weight.shape[-1] != model.patch_size:
        body["patch_embed.weight"] = resize_patch_embed(body["patch_embed.weight"], model.patch_size)
        notes.append(f"patch embedding: {weight.shape[-1]} px patches -> {model.patch_size} (FlexiViT's pseudo-inverse resize)")
    # the PE: the same family resampled to the new reference grid, another one from its own initialisation
    old_args = source.model_args
    old_ref = tuple(s // old_args["patch_size"] for s in to_2tuple(old_args["img_size"], "img_size"))
    same_pe = old_args["pos_embed"] == model_args["pos_embed"]
    if same_pe:
        try:
            pe = model.pos_embed.resampled_state(_pe_state(old), old_ref)
        except (KeyError, RuntimeError) as e:
            raise InitError(f"{source.spec}'s {old_args['pos_embed']} weights do not fit this {model_args['pos_embed']} ({e})") from None
        if old_ref != tuple(model.ref_grid) and pe:
            notes.append(f"pe {model_args['pos_embed']}: its tables resampled from the {old_ref[0]}x{old_ref[1]} grid to "
                         f"{model.ref_grid[0]}x{model.ref_grid[1]}; the rest reads the new grid's coordinates")
        body.update({f"pos_embed.{k}": v for k, v in pe.items()})
    else:
        dropped = len(_pe_state(old))
        body.update({k: v for k, v in new.items() if k.startswith("pos_embed.")})
        notes.append(f"pe {old_args['pos_embed']} -> {model_args['pos_embed']}: the source's PE parameters ({dropped} tensors) are dropped, "
                     f"{model_args['pos_embed']} starts from its own initialisation")
    # the head: kept for the same classes (rows in the new order), new for others
    head, line = _head(source, new, classes, n_out)
    body.update(head)
    notes.append(line)
    problems = _first_mismatches(new, body)
    if problems:
        raise InitError(f"{source.spec}'s weights do not fit the model built from its architecture ({problems})")
    model.load_state_dict(body)
    return model, notes


def _head(source: Source, new: Dict[str, Tensor], classes: Optional[List[str]], n_out: int) -> Tuple[Dict[str, Tensor], str]:
    """The head weights the new model (state dict ``new``) starts with, and the line that says which."""
    own = {k: v for k, v in new.items() if k.startswith(_HEADS)}
    old = {k: v for k, v in source.state.items() if k.startswith(_HEADS)}
    n_old = source.model_args.get("num_classes", 0)
    if classes is not None and source.classes is not None and sorted(classes) == sorted(source.classes) and set(old) == set(own):
        rows = torch.tensor([source.classes.index(c) for c in classes])
        kept = {k: v[rows] for k, v in old.items()}
        order = "" if list(classes) == list(source.classes) else " (its rows reordered to this data's class order)"
        return kept, f"head: kept, the same {len(classes)} classes{order}"
    if classes is None and source.classes is None and n_out == n_old and set(old) == set(own) and n_out > 0:
        return old, f"head: kept ({n_out} outputs; neither side names its classes)"
    if classes is None:
        why = f"{n_out} outputs asked, the source has {n_old}"
    elif source.classes is None:
        why = f"the source records no class names ({n_old} outputs)"
    else:
        why = f"the source's head predicts {n_old} classes ({class_mismatch(source.classes, classes)})"
    return own, f"head: new for {n_out} classes, freshly initialised ({why}), as timm's reset_classifier"


# ---- what trains ---------------------------------------------------------------------------------------------
def freeze(model: VisionTransformer, spec: Union[str, int]) -> List[str]:
    """Freeze part of ``model`` in place (``requires_grad=False``: no gradient, and so no optimizer state, weight decay or
    EMA drift): ``"none"``; ``"backbone"``, every parameter but the head's (a linear probe); N, the embeddings (patches,
    prefix tokens, PE) and the first N blocks. Returns the frozen parameters' names."""
    spec = frozen_spec(spec, len(model.blocks))
    if spec == "none":
        return []
    if spec == "backbone":
        keep = lambda name: name.startswith(_HEADS)  # noqa: E731
    else:
        trained_blocks = tuple(f"blocks.{i}." for i in range(spec, len(model.blocks)))
        embeddings = ("patch_embed.", "cls_token", "dist_token", "reg_token", "pos_embed.", "norm_pre.")
        keep = lambda name: not name.startswith(embeddings) and not (name.startswith("blocks.") and not name.startswith(trained_blocks))  # noqa: E731
    frozen = []
    for name, p in model.named_parameters():
        if not keep(name):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


_freeze = freeze  # init_from's argument of that name shadows it


def init_from(source: str, *, weights: Optional[str] = None, classes: Optional[Sequence[str]] = None, num_classes: Optional[int] = None,
              in_chans: Optional[int] = None, freeze: Union[str, int] = "none", log: Optional[Callable[[str], None]] = None,
              **changes: Any) -> VisionTransformer:
    """A :class:`VisionTransformer` ready to fine-tune from ``source`` (a run directory or checkpoint, a ``save_pretrained``
    folder, or ``"timm:NAME"`` with ``weights`` a file), for your own training loop; ``train.py --init`` runs the same code.

    ``classes``: the class names of your data (the head is kept where they are the source's, new otherwise), or
    ``num_classes``; ``in_chans``: your images' channels; ``changes``: what fine-tuning may change (:data:`FINE_TUNABLE`,
    e.g. ``img_size=64``, ``pos_embed="rope_mixed"``); ``freeze``: ``"none"``, ``"backbone"`` or N blocks (see
    :func:`freeze`). ``log`` receives one line per adaptation. The model is in training mode; its ``init_source`` says what
    it started from (``source``, ``weights``, ``sha256``)."""
    src = read_source(source, weights)
    args, notes = source_model_args(src, changes)
    args["in_chans"] = in_chans if in_chans is not None else src.model_args.get("in_chans", 3)
    model, more = start_model(src, args, classes, num_classes)
    frozen = _freeze(model, freeze)
    for line in src.notes + notes + more + ([f"frozen: {len(frozen)} parameter tensors ({freeze})"] if frozen else []):
        (log or (lambda s: None))(line)
    model.init_source = dict(src.provenance)
    return model.train()
