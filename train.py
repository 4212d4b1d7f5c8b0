#!/usr/bin/env python
"""Train a ViT classifier with any positional encoding: the command ``vitpe train`` (:mod:`vitpe.cli.train`) in a clone.

    python train.py                                        # shapes, the built-in dataset, ~4 min on 2 CPU cores
    python train.py --config configs/fashion_mnist.yaml --set model.pos_embed=rope_mixed
    python train.py --resume runs/shapes-sincos2d-20261121-120000
    torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml     # gloo on CPU, NCCL on GPUs
"""
import sys

from vitpe.cli.train import cli

if __name__ == "__main__":
    sys.exit(cli())
