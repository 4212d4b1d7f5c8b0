"""Positional encodings for vision transformers, each a function of continuous patch coordinates."""
# Import order matters: the families register as they are imported, in the order list_pos_embeds() reports.
from .base import PEOption, PosContext, PosEmbed
from .functional import (
    apply_rope,
    fourier_features,
    lattice_offsets,
    relative_offsets,
    relative_position_index,
    rope_angles,
    rotate_complex,
    rotate_pairs,
    sample_bias_table,
)
from .registry import (
    CombinedPosEmbed,
    build_pos_embed,
    check_pos_embed,
    list_pos_embeds,
    pe_parts,
    pe_test_options,
    pos_embed_info,
    pos_embed_options,
    register_pos_embed,
    set_pe_option,
    set_rope_extrapolation,
)

# Importing the families registers them; the order here is the order list_pos_embeds() reports.
from .additive import FourierPosEmbed, LearnedFourierPosEmbed, LearnedPosEmbed, NoPosEmbed, SinCos2d, sincos_1d, sincos_2d
from .bias import ALiBi2d, ContinuousPositionBias, FIRE, LookHere, RelativePositionBias, log_spaced, set_lookhere_slope
from .parabolic import PaPE
from .rotary import RopeAxial, RopeGolden, RopeMixed, RopeString, RotaryPosEmbed, axial_rope_freqs, mixed_rope_freqs
from .lie import ComRoPE, LieRE
from .conditional import PEG

DEFAULT_POS_EMBED = "sincos2d"  # the library's default encoding (a model's, a config's): fixed, no parameters, no cost
NO_POS_EMBED = "none"  # the family without position: the baseline every other is measured against
