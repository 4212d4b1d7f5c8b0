"""vitpe's ViTs in timm's model registry: ``timm.create_model("vitpe_small_patch16_224_rope_mixed")``.

Importing vitpe registers (as soon as timm is imported, before or after vitpe: vitpe itself never imports
timm, so its PE modules cost torch alone), for each architecture below, ``vitpe_<arch>`` (any PE through ``pos_embed=``) and
``vitpe_<arch>_<pe>`` for every registered PE family, so timm's scripts, ``timm.list_models("vitpe_*")`` and
``features_only=True`` (through :meth:`VisionTransformer.forward_intermediates`) work on vitpe models. No
pretrained weights: ``pretrained=True`` fails in timm with its own message.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from ..pos_embed import list_pos_embeds
from ..vit import VisionTransformer

__all__: List[str] = ["ARCHITECTURES", "timm_model_names"]

# name -> VisionTransformer arguments. "cifar" is the main job's model (configs/): 32 px, patch 4.
ARCHITECTURES: Dict[str, Dict[str, Any]] = {
    "cifar_patch4_32": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=2.0, num_classes=10),
    "tiny_patch16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small_patch16_224": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base_patch16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
}

default_cfgs: Dict[str, Dict[str, Any]] = {}  # timm's register_model reads each model's config from here


def _entrypoint(name: str, arch: Dict[str, Any], pos_embed: str | None) -> Callable[..., VisionTransformer]:
    from timm.models import build_model_with_cfg

    def create(pretrained: bool = False, device: Any = None, dtype: Optional[torch.dtype] = None, **kwargs: Any) -> VisionTransformer:
        # timm's factory passes device and dtype; they place the model, they are not its architecture (model_args)
        args = {**arch, **({"pos_embed": pos_embed} if pos_embed else {}), **kwargs}
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = build_model_with_cfg(
                VisionTransformer, name, pretrained, feature_cfg=dict(out_indices=3, feature_cls="getter"), **args
            )
        return model if dtype is None else model.to(dtype)

    create.__name__ = create.__qualname__ = name
    create.__doc__ = f"vitpe ViT {name}: {arch} with pos_embed={pos_embed or 'sincos2d (or pos_embed=...)'}"
    return create


GENERIC = "vitpe_vit"  # every argument from the caller: what vitpe.save_pretrained's config.json names (its model_args)


def timm_model_names() -> List[str]:
    """The names this module registers with timm."""
    return [GENERIC] + [f"vitpe_{a}" + (f"_{pe}" if pe else "") for a in ARCHITECTURES for pe in [None] + list_pos_embeds()]


def _register() -> None:
    if default_cfgs:  # already done
        return
    from timm.models import register_model

    size = lambda a: (3, a["img_size"], a["img_size"])  # noqa: E731
    # The generic entry names no classifier, so timm never drops a saved head for a num_classes it did not expect, and
    # has none by default (num_classes=0: pooled features), since a saved model's num_classes comes with its model_args.
    default_cfgs[GENERIC] = dict(url="", num_classes=0, input_size=(3, 224, 224), pool_size=None, crop_pct=1.0, interpolation="bicubic",
                                 mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), first_conv="patch_embed", classifier=None)
    fn = _entrypoint(GENERIC, {}, None)
    fn.__module__ = __name__
    globals()[GENERIC] = register_model(fn)
    for arch_name, arch in ARCHITECTURES.items():
        for pe in [None] + list_pos_embeds():
            name = f"vitpe_{arch_name}" + (f"_{pe}" if pe else "")
            default_cfgs[name] = dict(
                url="", num_classes=arch.get("num_classes", 1000), input_size=size(arch), pool_size=None, crop_pct=1.0,
                interpolation="bicubic", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), first_conv="patch_embed", classifier="head",
            )
            fn = _entrypoint(name, arch, pe)
            fn.__module__ = __name__
            globals()[name] = register_model(fn)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after the module ``name`` is first imported (a post-import hook), so that importing
    vitpe does not import timm, and timm's registry still knows vitpe's models whenever timm is used."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Optional[Any] = None, target: Optional[Any] = None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: find the real spec, then wrap its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run, callback = spec.loader.exec_module, self.callback

        def exec_module(module: Any) -> None:
            run(module)
            callback()

        spec.loader.exec_module = exec_module
        return spec


if "timm" in sys.modules:
    _register()
elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport("timm", _register))
