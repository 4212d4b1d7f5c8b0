"""vitpe: Vision Transformers and their positional encodings, as functions of continuous patch coordinates."""
from .coords import COORD_MODES, PatchGrid, grid_coords
from .pos_embed import (
    CombinedPosEmbed,
    PosContext,
    PosEmbed,
    apply_rope,
    build_pos_embed,
    fourier_features,
    list_pos_embeds,
    pos_embed_options,
    register_pos_embed,
    relative_position_index,
    rotate_pairs,
    sincos_1d,
    sincos_2d,
)
from .vit import Attention, Block, VisionTransformer

__version__ = "0.1.0"

__all__ = [
    "COORD_MODES",
    "PatchGrid",
    "grid_coords",
    "PosEmbed",
    "PosContext",
    "CombinedPosEmbed",
    "build_pos_embed",
    "list_pos_embeds",
    "pos_embed_options",
    "register_pos_embed",
    "sincos_1d",
    "sincos_2d",
    "fourier_features",
    "apply_rope",
    "rotate_pairs",
    "relative_position_index",
    "Attention",
    "Block",
    "VisionTransformer",
]
