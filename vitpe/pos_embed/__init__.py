"""Positional encodings for vision transformers, each a function of continuous patch coordinates."""
# Import order matters: the families register as they are imported, in the order list_pos_embeds() reports.
from .base import PosContext, PosEmbed
from .functional import (
    apply_rope,
    axial_rope_freqs,
    fourier_features,
    lattice_offsets,
    log_spaced,
    mixed_rope_freqs,
    relative_offsets,
    relative_position_index,
    rope_angles,
    rotate_complex,
    rotate_pairs,
    sample_bias_table,
    sincos_1d,
    sincos_2d,
)
from .registry import CombinedPosEmbed, build_pos_embed, list_pos_embeds, pos_embed_options, register_pos_embed, set_lookhere_slope, set_rope_extrapolation

# Importing the families registers them; the order here is the order list_pos_embeds() reports.
from .additive import FourierPosEmbed, LearnedFourierPosEmbed, LearnedPosEmbed, NoPosEmbed, SinCos2d
from .bias import ContinuousPositionBias, FIRE, LookHere, RelativePositionBias
from .rotary import RopeAxial, RopeGolden, RopeMixed, RopeString, RotaryPosEmbed
from .lie import ComRoPE, LieRE
from .conditional import PEG
