"""Exact mode's runtime check (quarl.trainer.exact_check): the first response token whose two
log-probs differ (hand-made batches), and the stage where the engine's forward and the
learner's part, on a tiny exact pair (Triton's interpreter) whose engine copy has one layer's
weights moved: named as that layer; with equal weights, no layer."""

from __future__ import annotations

import dataclasses

import torch

from quarl.config.run import QuantConfig
from quarl.model.presets import build_random_model, preset_config
from quarl.quant.mode import QuantMode
from quarl.rollout import EngineConfig
from quarl.trainer.exact_check import exact_warning, first_parting, parting_layer
from quarl.trainer.weights import build_engine_and_publisher


def test_the_first_parting_is_the_first_response_token_that_differs_row_major():
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    sampler = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -0.125, -1.0]])
    learner = sampler.clone()
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    assert first_parting(ids, learner, sampler, mask) is None
    learner[0, 3] = -4.5  # outside the mask: not a response token
    learner[1, 2] = -0.126
    learner[1, 3] = -2.0
    p = first_parting(ids, learner, sampler, mask)
    assert (p.row, p.position, p.token) == (1, 2, 9)
    assert (p.learner, p.sampler) == (float(torch.tensor(-0.126)), -0.125)
    learner[0, 1] = torch.nextafter(torch.tensor(-2.0), torch.tensor(0.0))  # one ulp is a parting too
    assert first_parting(ids, learner, sampler, mask).row == 0
    msg = exact_warning(7, 0.5, p, "layers.1 (token 0 differs most there, by 1.0e-02 of its norm)")
    assert msg.startswith("step 7: quant.exact=true, yet") and "response 1, the token at position 3 (id 9)" in msg
    assert "part at layers.1" in msg and "on another rank" in exact_warning(7, 0.5, None, None)


def test_the_stage_where_the_forwards_part_is_named():
    cfg = dataclasses.replace(preset_config("tiny"), vocab_size=64)
    model = build_random_model(cfg, dtype=torch.bfloat16, std=0.1)
    quant = QuantConfig(mode=QuantMode.BF16, exact=True)
    quant.validate()
    engine, _ = build_engine_and_publisher(model, quant, EngineConfig(max_model_len=16, block_size=4,
                                                                       num_kv_blocks=8))
    ids = [3, 9, 27, 17, 51, 25, 11, 33]
    assert parting_layer(engine, model, ids, 5).startswith("no layer: the engine's prefill")
    w = engine.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w[:, 0] = w[:, 0] * 1.01 + 0.01
    found = parting_layer(engine, model, ids, 5)
    assert found.startswith("layers.1 (token ") and "differs most there, by " in found, found
