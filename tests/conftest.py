import importlib.util
from pathlib import Path

import pytest
import torch

import vitpe

ROOT = Path(__file__).resolve().parents[1]

# Every registered family plus combinations that exercise each way of combining (additive+rotary,
# additive+bias+conditional, additive+per-layer bias+rotary with an orthogonal mix, additive+matrix rotary).
ALL_PE = vitpe.list_pos_embeds() + ["sincos2d+rope_mixed", "learned+rel_bias+peg", "learned+lookhere+string", "sincos2d+liere",
                                     "alibi2d+pape+rope_axial"]


def load_benchmark(name: str):
    """A fresh copy of the study ``benchmarks.NAME`` (its module state, which ``--smoke`` changes, is this test's own);
    it imports its kit as the package it is (``python -m benchmarks.NAME``)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_python():
    """The tests deliver SIGINT to themselves. A suite started in the background of a non-interactive shell (`cmd &`,
    `nohup`) inherits SIGINT ignored, and train.py rightly keeps an ignored signal ignored: give Python its handler."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
