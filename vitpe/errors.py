"""One family of errors a user can act on (the commands report them in one line: :func:`vitpe.cli.common.run_cli`).

Every error vitpe raises about bad input or state is a :class:`VitpeError` (a ``ValueError``, so callers that
catch ``ValueError`` keep working; the ones that were ``RuntimeError`` are both). Its message is one line that
says what is wrong and what to do; the commands print it as ``error: ...`` and exit with ``exit_code``.
"""
from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["VitpeError", "command_name"]


class VitpeError(ValueError):
    """Bad input or state, described in one line. ``exit_code``: 2 for what the user asked (config, names),
    1 for what was found (data, checkpoints, a diverged run)."""

    exit_code = 1


# How each command is typed in a clone (from its root); installed, or run through the ``vitpe`` command, it is ``vitpe NAME``.
CLONE_DOORS = {"train": "python train.py", "eval": "python eval.py", "predict": "python -m vitpe.predict",
               "export": "python -m vitpe.export", "viz": "python -m vitpe.viz", "shards": "python -m vitpe shards"}


def command_name(name: str) -> str:
    """How a user types command ``name`` here, for usage lines and the hints a run prints (``python train.py --resume
    RUN`` in a clone, ``vitpe train --resume RUN`` from an installed wheel or where the ``vitpe`` command is in use)."""
    installed = not (Path(__file__).resolve().parents[1] / "train.py").is_file()
    return f"vitpe {name}" if installed or sys.argv[0].startswith("vitpe ") else CLONE_DOORS[name]
