"""The one registry of positional encodings: names, options, and ``a+b`` combinations."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Type

import torch
from torch import Tensor, nn

from ..coords import COORD_MODES, PatchGrid, Size2
from ..suggest import did_you_mean
from .base import PosEmbed

__all__ = ["register_pos_embed", "list_pos_embeds", "build_pos_embed", "pos_embed_options", "CombinedPosEmbed", "set_rope_extrapolation",
           "set_lookhere_slope"]

_REGISTRY: Dict[str, Type[PosEmbed]] = {}
_COMMON = ("self", "dim", "num_heads", "ref_grid", "depth")


def register_pos_embed(name: str) -> Callable[[Type[PosEmbed]], Type[PosEmbed]]:
    """Class decorator: make a :class:`PosEmbed` subclass buildable by ``name``."""

    def wrap(cls: Type[PosEmbed]) -> Type[PosEmbed]:
        if "+" in name or name in _REGISTRY:
            raise ValueError(f"cannot register positional encoding {name!r}: name taken or contains '+'")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_pos_embeds() -> List[str]:
    """Registered encoding names, in registration order. Combine them with '+', e.g. 'sincos2d+rope_mixed'."""
    return list(_REGISTRY)


def pos_embed_options(name: str) -> Dict[str, Any]:
    """The options one registered encoding accepts, with their defaults. Every encoding takes ``coord_mode``
    (``None``: the model's), the coordinate mode of this encoding alone."""
    out: Dict[str, Any] = {}
    for klass in _lookup(name).__mro__:  # a subclass passes its base's options on as **kwargs: read those too
        params = inspect.signature(klass.__init__).parameters
        out.update({k: p.default for k, p in params.items() if k not in _COMMON and p.kind is p.KEYWORD_ONLY and k not in out})
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return {**out, "coord_mode": None}


def _lookup(name: str) -> Type[PosEmbed]:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown positional encoding {name!r}{did_you_mean(name, list(_REGISTRY))}; valid names: {', '.join(_REGISTRY)} (combine with '+')"
        )
    return _REGISTRY[name]


def build_pos_embed(name: str, *, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, **options: Any) -> PosEmbed:
    """Build a positional encoding by registry name, or a '+'-combination such as ``"sincos2d+rope_mixed"``.

    In a combination, an option goes to every part that accepts it; ``"part.option"`` targets one part.
    An unknown name, or an option no part accepts, raises ``ValueError`` naming the valid ones.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"positional encoding name must be a non-empty string, got {name!r}")
    parts = [p.strip() for p in name.split("+")]
    for p in parts:
        _lookup(p)
    if len(set(parts)) != len(parts):
        raise ValueError(f"positional encoding {name!r} names a part twice")
    per_part: Dict[str, Dict[str, Any]] = {p: {} for p in parts}
    for key, value in options.items():
        target, _, opt = key.rpartition(".")
        targets = [target] if target else [p for p in parts if opt in pos_embed_options(p)]
        if target and (target not in per_part or opt not in pos_embed_options(target)):
            targets = []
        if not targets:
            valid = sorted({(f"{p}." if len(parts) > 1 else "") + o for p in parts for o in pos_embed_options(p)})
            raise ValueError(
                f"unknown option {key!r} for positional encoding {name!r}{did_you_mean(key, valid)}; valid options: {', '.join(valid)}"
            )
        if opt == "coord_mode" and value is not None and value not in COORD_MODES:
            raise ValueError(f"{key}={value!r} is not a coordinate mode{did_you_mean(value, list(COORD_MODES))}; choose one of {', '.join(COORD_MODES)}")
        for t in targets:
            per_part[t][opt] = value
    common = dict(dim=dim, num_heads=num_heads, ref_grid=ref_grid, depth=depth)
    built = []
    for p in parts:
        mode = per_part[p].pop("coord_mode", None)
        built.append(_REGISTRY[p](**common, **per_part[p]))
        built[-1].coord_mode = mode
    return built[0] if len(built) == 1 else CombinedPosEmbed(built, **common)


class CombinedPosEmbed(PosEmbed):
    """Several encodings at once (e.g. RoPE-ViT's "+APE" variants): token terms and biases add up,
    at most one rotary part, conditional parts apply after their own blocks."""

    acts_on = "combined"

    def __init__(self, parts: List[PosEmbed], *, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1) -> None:
        super().__init__(dim, num_heads, ref_grid, depth)
        rotary = [p.name for p in parts if p.rotary]
        if len(rotary) > 1:
            raise ValueError(f"at most one rotary encoding can be combined, got {rotary}")
        self.parts = nn.ModuleList(parts)
        self.name = "+".join(p.name for p in parts)

    @property
    def rotary(self) -> bool:
        return any(p.rotary for p in self.parts)

    @property
    def biased(self) -> bool:
        return any(p.biased for p in self.parts)

    @staticmethod
    def _sum(values: List[Optional[Tensor]]) -> Optional[Tensor]:
        values = [v for v in values if v is not None]
        return None if not values else values[0] if len(values) == 1 else torch.stack(torch.broadcast_tensors(*values)).sum(0)

    def tokens(self, grid: PatchGrid) -> Optional[Tensor]:
        return self._sum([p.tokens(p.own_grid(grid)) for p in self.parts])

    def bias(self, grid: PatchGrid) -> Optional[Tensor]:
        return self._sum([p.bias(p.own_grid(grid)) for p in self.parts])

    def rope_angles(self, grid: PatchGrid) -> Optional[Tensor]:
        return self._sum([p.rope_angles(p.own_grid(grid)) for p in self.parts])

    def rope_rotations(self, grid: PatchGrid) -> Optional[Tensor]:
        return self._sum([p.rope_rotations(p.own_grid(grid)) for p in self.parts])  # at most one part is rotary

    def rope_mix(self) -> Optional[Tensor]:
        return self._sum([p.rope_mix() for p in self.parts])

    def rope_magnitude(self, grid: PatchGrid) -> Optional[Tensor]:
        return self._sum([p.rope_magnitude(p.own_grid(grid)) for p in self.parts])

    def condition_layers(self) -> FrozenSet[int]:
        return frozenset().union(*(p.condition_layers() for p in self.parts))

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return {f"parts.{i}.{k}": v for i, p in enumerate(self.parts) for k, v in p.from_timm(weights).items()}

    def condition(self, layer: int, x: Tensor, grid: PatchGrid) -> Tensor:
        for p in self.parts:
            if layer in p.condition_layers():
                x = p.condition(layer, x, grid)
        return x


def _clear_caches(module: nn.Module) -> None:
    """Drop every encoding's cached contexts in ``module``: after a test-time control changed, those cached by a
    combination or the model still hold what the old setting computed."""
    for m in module.modules():
        if isinstance(m, PosEmbed):
            m.clear_cache()


def set_rope_extrapolation(module: nn.Module, scaling: Optional[str] = None, p_rope: Optional[float] = None) -> List[str]:
    """Set the extrapolation controls of every rotary encoding in ``module`` (a model, a PE): ``scaling`` (``"none"``,
    ``"pi"``, ``"ntk"``, ``"yarn"``) and ``p_rope`` (fraction of lowest frequencies left unrotated); ``None`` keeps the
    current value. At evaluation time this is ``eval.py --rope-scaling``. Returns the names of the encodings changed;
    a module with no rotary encoding, or a control an encoding does not take, raises ``ValueError``."""
    rotary = [m for m in module.modules() if isinstance(m, PosEmbed) and m.rotary and not isinstance(m, CombinedPosEmbed)]
    if not rotary:
        names = [n for n, c in _REGISTRY.items() if c.rope_angles is not PosEmbed.rope_angles or c.rope_rotations is not PosEmbed.rope_rotations]
        raise ValueError(f"this model has no rotary positional encoding, so RoPE extrapolation controls do not apply; rotary families: {', '.join(names)}")
    for pe in rotary:
        if scaling is not None:
            pe.scaling = scaling
        if p_rope is not None:
            if not hasattr(pe, "p_rope"):
                raise ValueError(f"{pe.name} has no frequency table for p-RoPE to act on; p_rope applies to rope_axial, "
                                 "rope_mixed, rope_golden and string")
            pe.p_rope = p_rope
    _clear_caches(module)
    return [pe.name for pe in rotary]


def set_lookhere_slope(module: nn.Module, global_slope: float) -> List[str]:
    """Set the global slope of every LookHere encoding in ``module`` (a model, a PE): the factor of each head's
    distance penalty, fixed, so a trained model can be evaluated with another (``eval.py --lookhere-slope``). In
    interpolate mode, slope ``k`` at ``k`` times the training grid gives exactly the penalties of extrapolate mode at
    slope 1. Returns the names of the encodings changed; a module without LookHere raises ``ValueError``."""
    found = [m for m in module.modules() if isinstance(m, PosEmbed) and hasattr(type(m), "global_slope")]
    if not found:
        raise ValueError("this model has no lookhere positional encoding, so a LookHere slope does not apply")
    for pe in found:
        pe.global_slope = global_slope
    _clear_caches(module)
    return [pe.name for pe in found]
