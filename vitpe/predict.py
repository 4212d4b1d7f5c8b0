"""The clone's door to ``vitpe predict``: ``python -m vitpe.predict photo.png --run runs/NAME``. The command is
:mod:`vitpe.cli.predict`'s; reading files is :func:`vitpe.data.images.read_images`, classifying them
:func:`vitpe.evaluation.predict`."""
import sys

from vitpe.cli.predict import cli

if __name__ == "__main__":
    sys.exit(cli())
