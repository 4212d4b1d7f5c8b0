"""Seeing what a positional encoding does: the numbers (``analysis``) and the pictures (``plots``). The command line,
``python -m vitpe.viz``, is :mod:`vitpe.viz.cli`: it reads checkpoints and datasets through the evaluation module,
which draws with this package, so this package does not import it."""
from .analysis import attention_distance, attention_stats, pe_matrix, pe_similarity
from .plots import draw_distance, draw_maps, draw_matrix, finish_plot, pyplot

__all__ = ["pe_matrix", "pe_similarity", "attention_distance", "attention_stats", "pyplot", "finish_plot", "draw_matrix", "draw_maps",
           "draw_distance"]
