"""The clone's door to ``vitpe export``: ``python -m vitpe.export RUN --onnx PATH --hf DIR``. The command is
:mod:`vitpe.cli.export`'s; the graphs are :mod:`vitpe.onnx`'s (``vitpe.export_onnx``, ``vitpe.onnx_errors``)."""
import sys

from vitpe.cli.export import cli

if __name__ == "__main__":
    sys.exit(cli())
