"""The rotary table: float32 whatever the model dtype, the same in every copy of a model."""

from __future__ import annotations

import copy

import torch

from quarl.model.presets import preset_config
from quarl.model.transformer import Rotary, rope_inv_freq


def test_rotary_tables_stay_float32_through_casts_and_agree_between_copies():
    """A model cast to bf16 after its table grew (a float32 warm start) and a copy that grows
    its table after the cast (an engine's) index the same cos/sin: the frequencies and tables
    stay float32 and are rounded only when indexed."""
    cfg = preset_config("tiny")
    warm = Rotary(cfg)
    warm.ensure(300)  # grown in float32
    learner = copy.deepcopy(warm).to(torch.bfloat16)
    engine = copy.deepcopy(learner)
    engine.ensure(5000)  # grown after the cast
    assert learner.inv_freq.dtype == learner.cos_table.dtype == torch.float32
    assert torch.equal(learner.inv_freq, rope_inv_freq(cfg)[0])
    pos = torch.arange(512)
    for a, b in zip(learner(pos, torch.bfloat16), engine(pos, torch.bfloat16)):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
