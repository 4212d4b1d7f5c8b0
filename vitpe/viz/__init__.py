"""Every picture vitpe draws: what a positional encoding does (the numbers, ``analysis``; the pictures, ``plots``) and
a sweep's accuracy and attention against resolution (``sweep``). The command, ``vitpe viz``, is :mod:`vitpe.cli.viz`.
This package draws what it is given: it reads no checkpoint and no dataset."""
from .analysis import attention_distance, attention_stats, pe_matrix, pe_similarity
from .plots import draw_distance, draw_maps, draw_matrix, finish_plot, pyplot
from .sweep import plot_accuracy, plot_attention

__all__ = ["pe_matrix", "pe_similarity", "attention_distance", "attention_stats", "pyplot", "finish_plot", "draw_matrix", "draw_maps",
           "draw_distance", "plot_accuracy", "plot_attention"]
