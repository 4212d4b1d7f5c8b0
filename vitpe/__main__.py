"""``python -m vitpe COMMAND``: the ``vitpe`` command (vitpe/cli) where it is not on the PATH."""
import sys

from vitpe.cli import main

sys.exit(main())
