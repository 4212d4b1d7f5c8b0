import pytest
import torch

import vitpe

# Every registered family plus combinations that exercise each way of combining (additive+rotary,
# additive+bias+conditional, additive+per-layer bias+rotary with an orthogonal mix, additive+matrix rotary).
ALL_PE = vitpe.list_pos_embeds() + ["sincos2d+rope_mixed", "learned+rel_bias+peg", "learned+lookhere+string", "sincos2d+liere"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
