"""Seeing what a positional encoding does: the numbers (``analysis``), the pictures (``plots``) and the
command line (``cli``, run as ``python -m vitpe.viz``)."""
from .analysis import attention_distance, attention_stats, pe_matrix, pe_similarity
from .cli import cli, main
from .plots import draw_distance, draw_maps, draw_matrix, finish_plot, pyplot

__all__ = ["pe_matrix", "pe_similarity", "attention_distance", "attention_stats", "pyplot", "finish_plot", "draw_matrix", "draw_maps",
           "draw_distance", "main", "cli"]
