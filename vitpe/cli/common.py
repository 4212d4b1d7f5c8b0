"""What every command shares: the argument types (one size parser for ``N`` and ``HxW``, whole numbers) and the one
error convention: an error is one line on stderr, ``error: WHAT; WHAT TO DO``, and an exit code, never a traceback.

Exit codes: 2 for what the user asked (a flag, a name, a size, a config, a path to write: :class:`vitpe.errors.VitpeError`
with ``exit_code = 2``, the library's own ``ValueError`` checks, a file that exists), 1 for what was found (data,
checkpoints, a diverged run, a full disk, a package that is missing), 128 + N for a run stopped by signal N.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence, Tuple

from ..errors import VitpeError

__all__ = ["parse_size", "whole_number", "positive_int", "count", "route_arg", "run_cli"]


def parse_size(text: str) -> Tuple[int, int]:
    """An image size as every command takes it: ``N`` (square) or ``HxW``; ``(height, width)``."""
    h, sep, w = text.strip().lower().partition("x")
    try:
        size = int(h), int(w if sep else h)  # "16x" is a typo, not 16x16
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} must be N or HxW, e.g. 64 or 32x48") from None
    if min(size) < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return size


def whole_number(text: str, minimum: int = 1) -> int:
    """An argparse type: a whole number of at least ``minimum``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def count(text: str) -> int:
    return whole_number(text, 0)


def route_arg(text: str) -> str:
    """An argparse type: ``auto`` (the run's route plan) or a route (``coords``, ``coords:MODE``, ``patch``, ``resize``)."""
    from ..route_plan import PlanError, Route

    if text != "auto":
        try:
            Route.parse(text, "interpolate")
        except PlanError as e:
            raise argparse.ArgumentTypeError(f"{e}; or auto (the run's plan)") from None
    return text


def run_cli(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run a command's ``main``: its errors become one line on stderr and an exit code (see the module's)."""
    try:
        return main(argv)
    except VitpeError as e:
        return _fail(str(e), e.exit_code)
    except ValueError as e:  # raised by the library's own argument checks (a model's size, a PE's option)
        return _fail(str(e), 2)
    except ImportError as e:  # an optional package a command needs (onnx, onnxruntime, safetensors)
        return _fail(f"{e}; install it (pip install 'vitpe[test]' has every optional package)", 1)
    except OSError as e:
        if e.errno is None:  # raised by vitpe about a path the user gave (a file that exists, the run's own checkpoint)
            return _fail(str(e), 2)
        # disk full, permissions: one line naming the file
        return _fail(f"{e.strerror or e} ({e.filename or 'while writing'}); free space or fix the path, then run again "
                     "(a training run: --resume)", 1)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
