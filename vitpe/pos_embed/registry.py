"""The one registry of positional encodings: names, options, and ``a+b`` combinations."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Type

import torch
from torch import Tensor, nn

from ..coords import CoordMode, PatchGrid, Size2
from ..suggest import did_you_mean
from .base import PEOption, PosContext, PosEmbed

__all__ = ["register_pos_embed", "list_pos_embeds", "build_pos_embed", "pos_embed_options", "pos_embed_info", "CombinedPosEmbed",
           "pe_parts", "pe_test_options", "set_pe_option", "set_rope_extrapolation", "check_pos_embed"]

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
    """Registered encoding names, in registration order. Combine them with '+', e.g. 'A+B'."""
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


def pos_embed_info(name: str) -> Dict[str, Any]:
    """What one registered family declares about itself: what it acts on, whether it reads coordinates, whether it
    rotates q and k or adds an attention bias, what coordinates per image cost it, other cost notes, and the options a
    trained model of it may change at test time (``{option: help}``)."""
    cls = _lookup(name)
    return {"acts_on": cls.acts_on, "reads_coords": cls.reads_coords, "rotary": _overrides(cls, "rope_angles", "rope_rotations"),
            "biased": _overrides(cls, "bias"), "per_image_cost": cls.per_image_cost, "cost_note": cls.cost_note,
            "test_options": {o.name: o.help for o in cls.test_options}}


def _overrides(cls: Type[PosEmbed], *hooks: str) -> bool:
    return any(getattr(cls, h) is not getattr(PosEmbed, h) for h in hooks)


def _families(has: Callable[[Type[PosEmbed]], bool]) -> str:
    """The registered families for which ``has(cls)``, as a phrase: 'a, b and c'."""
    names = [n for n, c in _REGISTRY.items() if has(c)]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def _lookup(name: str) -> Type[PosEmbed]:
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown positional encoding {name!r}{did_you_mean(name, list(_REGISTRY))}; valid names: {', '.join(_REGISTRY)} (combine with '+')"
        )
    return _REGISTRY[name]


def check_pos_embed(name: str, options: Optional[Dict[str, Any]] = None) -> Dict[str, Dict[str, Any]]:
    """The options of each part of encoding ``name`` (a registry name or a '+'-combination), as :func:`build_pos_embed`
    routes them, without building anything: an unknown family or option, or a part named twice, is a ``ValueError``
    in one line naming the valid ones. A config file's model is checked with this when it is read, before any data."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"positional encoding name must be a non-empty string, got {name!r}")
    parts = [p.strip() for p in name.split("+")]
    for p in parts:
        _lookup(p)
    if len(set(parts)) != len(parts):
        raise ValueError(f"positional encoding {name!r} names a part twice")
    per_part: Dict[str, Dict[str, Any]] = {p: {} for p in parts}
    for key, value in (options or {}).items():
        target, _, opt = key.rpartition(".")
        targets = [target] if target else [p for p in parts if opt in pos_embed_options(p)]
        if target and (target not in per_part or opt not in pos_embed_options(target)):
            targets = []
        if not targets:
            valid = sorted({(f"{p}." if len(parts) > 1 else "") + o for p in parts for o in pos_embed_options(p)})
            raise ValueError(
                f"unknown option {key!r} for positional encoding {name!r}{did_you_mean(key, valid)}; valid options: {', '.join(valid)}"
            )
        if opt == "coord_mode" and value is not None:
            value = CoordMode.parse(value, key)
        for t in targets:
            per_part[t][opt] = value
    return per_part


def build_pos_embed(name: str, *, dim: int, num_heads: int, ref_grid: Size2, depth: int = 1, **options: Any) -> PosEmbed:
    """Build a positional encoding by registry name, or a '+'-combination of them (``"A+B"``: an additive encoding with a rotary one, say).

    In a combination, an option goes to every part that accepts it; ``"part.option"`` targets one part.
    An unknown name, or an option no part accepts, raises ``ValueError`` naming the valid ones.
    """
    per_part = check_pos_embed(name, options)
    common = dict(dim=dim, num_heads=num_heads, ref_grid=ref_grid, depth=depth)
    built = []
    for p in per_part:
        mode = per_part[p].pop("coord_mode", None)
        built.append(_REGISTRY[p](**common, **per_part[p]))
        built[-1].coord_mode = mode
    return built[0] if len(built) == 1 else CombinedPosEmbed(built, **common)


class CombinedPosEmbed(PosEmbed):
    """Several encodings at once (e.g. RoPE-ViT's "+APE" variants). Each part builds its own context on its own
    coordinates, and :meth:`PosContext.merge` combines them, one rule per mechanism: token terms and biases add up, at
    most one part rotates q and k, conditional parts apply after their own blocks."""

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

    @property
    def learned_bias(self) -> bool:
        return any(p.learned_bias for p in self.parts)

    def train_floats_per_token(self) -> int:
        return sum(p.train_floats_per_token() for p in self.parts)

    @property
    def bias_tables(self) -> int:
        return sum(p.bias_tables for p in self.parts)

    def infer_floats_per_token(self) -> int:
        return sum(p.infer_floats_per_token() for p in self.parts)

    def table_floats_per_token(self) -> int:
        return sum(p.table_floats_per_token() for p in self.parts)

    @property
    def reads_coords(self) -> bool:
        return any(p.reads_coords for p in self.parts)

    def condition_layers(self) -> FrozenSet[int]:
        return frozenset().union(*(p.condition_layers() for p in self.parts))

    def onnx_refusal(self) -> Optional[str]:
        return next((f"its part {p.name}: {why}" for p in self.parts if (why := p.onnx_refusal())), None)

    def size_choice(self) -> Optional[str]:
        return next((f"its part {p.name}: {why}" for p in self.parts if (why := p.size_choice())), None)

    def _build_context(self, grid: PatchGrid, num_prefix: int, dtype: torch.dtype) -> PosContext:
        return PosContext.merge([p.context(grid, num_prefix, dtype) for p in self.parts])

    def from_timm(self, weights: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return {f"parts.{i}.{k}": v for i, p in enumerate(self.parts) for k, v in p.from_timm(weights).items()}

    def resampled_state(self, state: Dict[str, Tensor], from_grid: Size2) -> Dict[str, Tensor]:
        out = {}
        for i, part in enumerate(self.parts):
            prefix = f"parts.{i}."
            own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            out.update({prefix + k: v for k, v in part.resampled_state(own, from_grid).items()})
        return out


def pe_parts(module: nn.Module) -> List[PosEmbed]:
    """Every encoding in ``module`` (a model, a PE), a combination counted as its parts."""
    return [m for m in module.modules() if isinstance(m, PosEmbed) and not isinstance(m, CombinedPosEmbed)]


def _clear_caches(module: nn.Module) -> None:
    """Drop every encoding's cached contexts in ``module``: after a test-time option changed, those cached by a
    combination or the model still hold what the old setting computed."""
    for m in module.modules():
        if isinstance(m, PosEmbed):
            m.clear_cache()


def pe_test_options(module: Optional[nn.Module] = None) -> Dict[str, PEOption]:
    """The test-time options the encodings in ``module`` declare (``None``: every registered family), as
    ``{"family.option": PEOption}``."""
    owners = [(c.name, c) for c in _REGISTRY.values()] if module is None else [(p.name, p) for p in pe_parts(module)]
    return {f"{name}.{o.name}": o for name, owner in owners for o in owner.test_options}


def set_pe_option(module: nn.Module, key: str, value: Any) -> List[str]:
    """Set a test-time option on every encoding in ``module`` (a model, a PE) that declares it: ``key`` is ``option``
    (every part that takes it) or ``family.option`` (that family's); a text ``value`` is parsed as the option says.
    ``eval.py --pe-option KEY=VALUE`` is this. Returns the names of the encodings changed; an option no encoding of
    the model takes, or a value it refuses, raises ``ValueError`` in one line."""
    family, _, name = key.rpartition(".")
    targets = [(p, o) for p in pe_parts(module) for o in p.test_options if o.name == name and family in ("", p.name)]
    if not targets:
        declared = list(pe_test_options(module))
        names = "+".join(p.name for p in pe_parts(module)) or "none"
        raise ValueError(f"no positional encoding of this model ({names}) takes the test-time option {key!r}"
                         f"{did_you_mean(key, declared + sorted({d.partition('.')[2] for d in declared}))}; "
                         + (f"its options: {', '.join(declared)}" if declared else "it has none"))
    for pe, option in targets:
        try:
            parsed = option.parse(value) if isinstance(value, str) else value
            before = getattr(pe, option.attr)
            setattr(pe, option.attr, parsed)  # the family's own check speaks first
            if isinstance(parsed, float) and not math.isfinite(parsed):  # NaN logits would score as a low top-1, silently
                setattr(pe, option.attr, before)
                raise ValueError("must be a finite number")
        except (TypeError, ValueError) as e:
            raise ValueError(f"{pe.name}.{option.name}={value!r}: {e}") from None
    _clear_caches(module)
    return [pe.name for pe, _ in targets]


def set_rope_extrapolation(module: nn.Module, scaling: Optional[str] = None, p_rope: Optional[float] = None) -> List[str]:
    """Set the extrapolation controls of every rotary encoding in ``module`` (a model, a PE): ``scaling`` (``"none"``,
    ``"pi"``, ``"ntk"``, ``"yarn"``) and ``p_rope`` (fraction of lowest frequencies left unrotated); ``None`` keeps the
    current value. At evaluation time this is ``eval.py --rope-scaling``. Returns the names of the encodings changed;
    a module with no rotary encoding, or a control an encoding does not take, raises ``ValueError``."""
    rotary = [p for p in pe_parts(module) if p.rotary]
    if not rotary:
        raise ValueError("this model has no rotary positional encoding, so RoPE extrapolation controls do not apply; rotary "
                         f"families: {_families(lambda c: _overrides(c, 'rope_angles', 'rope_rotations'))}")
    given = {option: value for option, value in (("scaling", scaling), ("p_rope", p_rope)) if value is not None}
    declares = lambda cls, name: any(o.name == name for o in cls.test_options)  # noqa: E731
    for option in given:  # every rotary part must take it: a control that reaches only some of them would mislead
        lacking = [p.name for p in rotary if not declares(p, option)]
        if lacking:
            raise ValueError(f"{lacking[0]} does not take {option} (it has no frequency table for it to act on); {option} "
                             f"applies to {_families(lambda c: declares(c, option))}")
    for option, value in given.items():  # the declared options, as eval.py --rope-scaling / --p-rope set them
        set_pe_option(module, option, value)
    return [pe.name for pe in rotary]
