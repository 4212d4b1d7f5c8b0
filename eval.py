#!/usr/bin/env python
"""Evaluate trained checkpoints at several resolutions: the command ``vitpe eval`` (:mod:`vitpe.cli.eval`) in a clone.

    python eval.py runs/shapes-sincos2d-...                            # 0.5x .. 2x the training size
    python eval.py runs/A runs/B --resolutions 16 32 48 64 128         # compare runs on one table and plot
    python eval.py runs/A --resolutions 32x48 --coord-mode both       # non-square; both coordinate modes
"""
import sys

from vitpe.cli.eval import cli

if __name__ == "__main__":
    sys.exit(cli())
