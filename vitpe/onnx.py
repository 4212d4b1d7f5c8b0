"""Ship a vitpe model as an ONNX graph that takes any input size.

:func:`export_onnx` writes a graph whose batch, height and width are free: the patch grid, its coordinates, the PE's
tables, biases and rotations (real-valued: ONNX has no complex numbers) are computed inside the graph from the input's
shape, so one file serves every resolution, as the model does. :func:`onnx_errors` runs the file with onnxruntime
against the model. The command, ``vitpe export`` (:mod:`vitpe.cli.export`), does both, and timm's layout
(:func:`vitpe.save_pretrained`), for a trained run::

    python -m vitpe.export runs/main --onnx model.onnx          # EMA weights if the run kept them
    python -m vitpe.export runs/main --hf shared/ --raw         # the raw weights, for timm.create_model / the hub
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .timm.pretrained import preprocessing
from .vit import VisionTransformer

__all__ = ["export_onnx", "onnx_errors", "onnx_refusal", "ONNX_OPSET"]

ONNX_OPSET = 17  # LayerNormalization's; GridSample (learned tables at new sizes) needs 16


def onnx_refusal(model: VisionTransformer) -> Optional[str]:
    """Why ``model`` cannot be exported to an any-size ONNX graph, in one line (``None``: it can)."""
    if not isinstance(model, VisionTransformer):
        return f"export_onnx takes a vitpe.VisionTransformer (vitpe.vit_from_timm converts timm's), not a {type(model).__name__}"
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # bf16 graphs are rejected by onnxruntime's CPU kernels, fp64 ones lack kernels to run
        return f"the model's weights are {str(dtype).replace('torch.', '')}; ONNX export takes float32: export model.float()"
    why = model.pos_embed.onnx_refusal()
    return None if why is None else f"the {model.pos_embed.name!r} PE cannot be exported to ONNX: {why}"


def _example_size(model: VisionTransformer, patch_size: Optional[int] = None) -> Tuple[int, int]:
    """The input traced: one and two patches past the reference grid, so that no shortcut taken only at the reference
    grid or on a square one is what the graph records."""
    (h, w), p = model.ref_grid, patch_size or model.patch_size
    return (h + 1) * p, (w + 2) * p


def export_onnx(model: VisionTransformer, path: Union[str, Path], *, opset: int = ONNX_OPSET, overwrite: bool = False,
                patch_size: Optional[int] = None, metadata: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``model`` as an ONNX graph at ``path``: input ``images`` ``(batch, channels, height, width)`` with batch,
    height and width free (any multiple of the patch size), output ``logits`` ``(batch, classes)``; the model's
    coordinate mode and PE options as they are now. ``patch_size``: the graph runs the model with its patch embedding
    resized to that size (FlexiViT's patch route; inputs are then multiples of it). ``metadata``: entries that replace
    or join the preprocessing the file carries (a route's ``input_size``). The file is written whole or not at all; an
    existing one is kept unless ``overwrite=True``. A PE that cannot be exported (an operator ONNX lacks) raises
    ``ValueError`` in one line. Image batches only: packed and per-image-coordinate inputs stay in PyTorch."""
    why = onnx_refusal(model)
    if why:
        raise ValueError(why)
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give the file to write, e.g. {path / 'model.onnx'}")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it, or choose another path")
    if path.exists() and _is_torch_file(path):
        raise FileExistsError(f"{path} is a PyTorch checkpoint, not an ONNX file: --overwrite replaces only ONNX files; "
                              "choose another path")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    x = torch.zeros(1, model.in_chans, *_example_size(model, patch_size), device=next(model.parameters()).device)
    buffer, was_training = io.BytesIO(), model.training
    model.eval()
    try:
        if patch_size is not None:  # the resized kernel made once here, so that the graph holds it as a constant
            with torch.no_grad():
                model.patchify(x, patch_size)
        with warnings.catch_warnings(), torch.no_grad(), _quiet_stdout():
            # the tracer warns at every size it reads; the graph keeps them symbolic (tests check three sizes)
            warnings.simplefilter("ignore")
            torch.onnx.export(_WholePatches(model, patch_size), (x,), buffer, dynamo=False, opset_version=opset, input_names=["images"],
                              output_names=["logits"], dynamic_axes={"images": {0: "batch", 2: "height", 3: "width"},
                                                                     "logits": {0: "batch"}})
    except ModuleNotFoundError as e:  # torch.onnx's own needs (onnx, onnxscript in some torch builds)
        raise ImportError(f"exporting to ONNX needs the {e.name} package: pip install 'vitpe[onnx]'") from None
    except torch.onnx.errors.UnsupportedOperatorError as e:
        raise ValueError(f"this model cannot be exported to ONNX: {str(e).splitlines()[0]}") from None
    finally:
        model.train(was_training)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(_with_metadata(buffer.getvalue(), model, metadata))
        tmp.replace(path)
    except OSError as e:  # a read-only or full disk: one line, and no half-written file left
        tmp.unlink(missing_ok=True)
        raise OSError(f"cannot write {path}: {e.strerror or e}") from None
    return path


class _WholePatches(torch.nn.Module):
    """The model as the graph records it: an input whose sides are not multiples of the patch size fails in the
    runtime (a Reshape to whole patches), as PyTorch refuses it, instead of answering for its top-left crop."""

    def __init__(self, model: VisionTransformer, patch_size: Optional[int] = None) -> None:
        super().__init__()
        self.model, self.patch_size = model, patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.patch_size or self.model.patch_size
        x = x.reshape(b, c, h // p * p, w // p * p)
        return self.model(x) if self.patch_size is None else self.model(x, patch_size=self.patch_size)


@contextlib.contextmanager
def _quiet_stdout():
    """Standard output silenced at the file descriptor: torch's ONNX exporter prints its whole IR graph from C++ when
    an operator fails, and the one-line error is what the user needs."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real descriptor (a notebook): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _is_torch_file(path: Path) -> bool:
    """Whether ``path`` holds what ``torch.save`` writes (a zip archive, or a legacy pickle)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head == b"PK\x03\x04" or head[:1] == b"\x80"


def _with_metadata(graph: bytes, model: VisionTransformer, extra: Optional[Dict[str, Any]] = None) -> bytes:
    """The ONNX file with what its images need as metadata (onnxruntime: ``session.get_modelmeta().custom_metadata_map``),
    each value JSON: ``input_size``, ``interpolation``, ``crop_pct``, ``mean``, ``std`` and, where known, ``label_names``,
    as :func:`vitpe.save_pretrained` writes them; ``extra`` replaces or joins them (a route's ``input_size`` and
    ``vitpe_route``)."""
    import onnx

    proto = onnx.load_from_string(graph)
    for key, value in {**preprocessing(model), **(extra or {})}.items():
        if key not in ("first_conv", "classifier"):
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, json.dumps(value)
    return proto.SerializeToString()


def onnx_errors(model: VisionTransformer, path: Union[str, Path], sizes: Sequence[Tuple[int, int]], batch: int = 2,
                seed: int = 0, patch_size: Optional[int] = None) -> Dict[Tuple[int, int], float]:
    """Relative difference ``max |onnx - torch| / max |torch|`` of the logits, per input size, on random images: the
    check that an exported graph computes what the model computes at sizes it was not traced at (needs onnxruntime).
    ``patch_size``: the model runs with its patch embedding resized to it, as a graph :func:`export_onnx` wrote with it."""
    try:
        import onnxruntime
    except ImportError:
        raise ImportError("checking an ONNX file needs onnxruntime: pip install onnxruntime (or vitpe's test extra)") from None
    if batch < 1:
        raise ValueError(f"onnx_errors needs at least one image per batch, got batch={batch}")
    for size in sizes:
        model.grid_size(size, patch_size)  # a size that is not a multiple of the patch size: one line, before anything runs
    try:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 4  # its errors come back as exceptions, said here in one line; no log lines too
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own classes for a missing or foreign file
        raise ValueError(f"{path} is not an ONNX file onnxruntime can run ({str(e).splitlines()[0][:160]})") from None
    g = torch.Generator().manual_seed(seed)
    out, was_training = {}, model.training
    model.eval()
    try:
        for h, w in sizes:
            x = torch.randn(batch, model.in_chans, h, w, generator=g)
            with torch.no_grad():
                x_in = x.to(next(model.parameters()).device)
                want = (model(x_in) if patch_size is None else model(x_in, patch_size=patch_size)).float().cpu()
            try:
                got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
            except Exception as e:
                raise ValueError(f"{path} does not run on this model's input {tuple(x.shape)}: is it this model's file? "
                                 f"({str(e).splitlines()[0][:160]})") from None
            if got.shape != want.shape:
                raise ValueError(f"{path} gives logits of shape {tuple(got.shape)} and the model {tuple(want.shape)}: it is "
                                 "another model's file")
            out[(h, w)] = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))
    finally:
        model.train(was_training)
    return out
