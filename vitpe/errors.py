"""One family of errors a user can act on, and the one way the command lines report them.

Every error vitpe raises about bad input or state is a :class:`VitpeError` (a ``ValueError``, so callers that
catch ``ValueError`` keep working; the ones that were ``RuntimeError`` are both). Its message is one line that
says what is wrong and what to do; the command lines print it as ``error: ...`` and exit with ``exit_code``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, List, Optional

__all__ = ["VitpeError", "run_cli", "command_name"]


class VitpeError(ValueError):
    """Bad input or state, described in one line. ``exit_code``: 2 for what the user asked (config, names),
    1 for what was found (data, checkpoints, a diverged run)."""

    exit_code = 1


# How each command is typed in a clone (from its root); installed, or run through the ``vitpe`` command, it is ``vitpe NAME``.
CLONE_DOORS = {"train": "python train.py", "eval": "python eval.py", "predict": "python -m vitpe.predict",
               "export": "python -m vitpe.export", "viz": "python -m vitpe.viz"}


def command_name(name: str) -> str:
    """How a user types command ``name`` here, for usage lines and the hints a run prints (``python train.py --resume
    RUN`` in a clone, ``vitpe train --resume RUN`` from an installed wheel or where the ``vitpe`` command is in use)."""
    installed = not (Path(__file__).resolve().parents[1] / "train.py").is_file()
    return f"vitpe {name}" if installed or sys.argv[0].startswith("vitpe ") else CLONE_DOORS[name]


def run_cli(main: Callable[[Optional[List[str]]], int], argv: Optional[List[str]] = None) -> int:
    """Run a command line's ``main``; errors become one line on stderr and an exit code, never a traceback."""
    try:
        return main(argv)
    except VitpeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # raised by the library's own argument checks (a model's size, a PE's option)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, permissions: one line naming the file
        print(f"error: {e.strerror or e} ({e.filename or 'while writing'}); free space or fix the path, then run again "
              "(a training run: --resume)", file=sys.stderr)
        return 1
