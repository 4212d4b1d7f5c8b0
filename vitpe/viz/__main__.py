"""The clone's door, ``python -m vitpe.viz``: the command itself is :mod:`vitpe.cli.viz`'s."""
import sys

from vitpe.cli.viz import cli

sys.exit(cli())
