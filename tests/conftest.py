import sys
from pathlib import Path

import pytest
import torch

import vitpe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # train.py and eval.py are scripts at the top

# Every registered family plus combinations that exercise each way of combining (additive+rotary,
# additive+bias+conditional).
ALL_PE = vitpe.list_pos_embeds() + ["sincos2d+rope_mixed", "learned+rel_bias+peg"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
