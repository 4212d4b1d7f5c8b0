"""vitpe: Vision Transformers and their positional encodings, as functions of continuous patch coordinates."""
from . import timm_models  # registers vitpe_* architectures with timm.create_model
from .coords import COORD_MODES, CoordAugment, PatchGrid, TokenGrid, cell_coords, grid_coords, patch_units
from .finetune import freeze, init_from
from .interop import cpb_from_swinv2, equip_timm_vit
from .packing import Packed, PackingError, image_patches, pack_images, pack_patches
from .patch import resize_patch_embed
from .pos_embed import (
    CombinedPosEmbed,
    PosContext,
    PosEmbed,
    apply_rope,
    build_pos_embed,
    fourier_features,
    list_pos_embeds,
    pe_test_options,
    pos_embed_info,
    pos_embed_options,
    register_pos_embed,
    relative_position_index,
    rotate_complex,
    rotate_pairs,
    set_lookhere_slope,
    set_pe_option,
    set_rope_extrapolation,
    sincos_1d,
    sincos_2d,
)
from .pretrained import from_pretrained, save_pretrained
from .timm_convert import load_timm_state_dict, vit_from_timm
from .vit import Attention, Block, LayerScale, VisionTransformer

__version__ = "0.1.0"

# vitpe.export is also a command (python -m vitpe.export): imported here first, runpy would warn that it runs a second
# copy of a module already loaded. Its functions load on first use instead.
_LAZY = {"export": "export", "export_onnx": "export", "onnx_errors": "export"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        module = import_module(f".{_LAZY[name]}", __name__)
        return module if name == _LAZY[name] else getattr(module, name)
    raise AttributeError(f"module 'vitpe' has no attribute {name!r}")

__all__ = [
    "COORD_MODES",
    "PatchGrid",
    "TokenGrid",
    "CoordAugment",
    "cell_coords",
    "patch_units",
    "Packed",
    "PackingError",
    "pack_images",
    "pack_patches",
    "image_patches",
    "resize_patch_embed",
    "grid_coords",
    "PosEmbed",
    "PosContext",
    "CombinedPosEmbed",
    "build_pos_embed",
    "list_pos_embeds",
    "pos_embed_options",
    "register_pos_embed",
    "pos_embed_info",
    "pe_test_options",
    "set_pe_option",
    "set_rope_extrapolation",
    "set_lookhere_slope",
    "sincos_1d",
    "sincos_2d",
    "fourier_features",
    "apply_rope",
    "rotate_complex",
    "rotate_pairs",
    "relative_position_index",
    "Attention",
    "Block",
    "LayerScale",
    "VisionTransformer",
    "equip_timm_vit",
    "vit_from_timm",
    "load_timm_state_dict",
    "cpb_from_swinv2",
    "save_pretrained",
    "from_pretrained",
    "init_from",
    "freeze",
    "export_onnx",
    "onnx_errors",
]
