"""The engine's record of an MoE model's expert choices (``Engine(record_routes=True)``):
per completion, the experts each prompt and response position ran in each MoE layer, equal
to a teacher-forced forward's own routing of the same tokens (float32 on the CPU: exact),
through shared prompts, lookahead, preemption and recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quarl.model.moe import SparseMoeBlock, moe_layer_ids, moe_routing, stacked_routes
from quarl.model.presets import build_random_model
from quarl.rollout import Engine, EngineConfig, SamplingParams
from quarl.rollout.sequence import RouteLog

PROMPTS = [[1, 5, 9, 13, 40, 41, 42], [7, 8, 9], [20, 21, 22, 23, 24], [100, 3, 17, 64, 2, 99, 5, 6, 11]]


def _engine(record: bool = True, preset: str = "moe-tiny", **config) -> Engine:
    model = build_random_model(preset, seed=3, std=0.2)
    return Engine(model, config=EngineConfig(max_model_len=40, block_size=4, **config), record_routes=record)


def _own_routes(engine: Engine, tokens: list[int]) -> np.ndarray:
    """The engine model's own routing of ``tokens`` in one teacher-forced forward ``[T, L, k]``."""
    with torch.no_grad(), moe_routing(engine.model) as routing:
        engine.model(torch.tensor([tokens]))
    return stacked_routes(routing, moe_layer_ids(engine.model)).numpy()


def _check(engine: Engine, outs) -> None:
    layers = len(moe_layer_ids(engine.model))
    for c in outs:
        tokens = PROMPTS[c.prompt_index] + c.token_ids
        assert c.routes.dtype == np.int16 and c.routes.shape == (len(tokens), layers, 2)
        assert (c.routes[-1] == -1).all() and (c.routes[:-1] >= 0).all()  # the last token was never fed
        own = _own_routes(engine, tokens)
        np.testing.assert_array_equal(np.sort(c.routes[:-1], -1), np.sort(own[:-1], -1))


@pytest.mark.parametrize("lookahead", [True, False])
def test_recorded_routes_are_the_models_own_routes_of_the_tokens(lookahead):
    """Prefill and decode steps (lookahead queues a step behind the one being collected: its
    routes land in the other host slot), sequences stopping at different steps."""
    engine = _engine(num_kv_blocks=256, lookahead=lookahead)
    probe = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=1, ignore_eos=True))
    stops = torch.bincount(torch.tensor(sum((c.token_ids for c in probe), []))).argsort(descending=True)[:2].tolist()
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=6 + 2 * i, seed=11 + i, stop_token_ids=stops)
              for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    assert {c.finish_reason for c in outs} == {"stop", "length"}
    _check(engine, outs)
    # a teacher-forced forward on the engine's model leaves its recording in place
    blocks = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert all(b.routing is engine.runner.routing for b in blocks)


def test_the_samples_of_a_prompt_share_its_prefills_routes(monkeypatch):
    """One prefill runs a prompt for its ``n`` samples: they are given the same rows (one
    array, not a copy each), and their completions carry them."""
    given: dict[int, list] = {}
    original = RouteLog.set_prefix

    def spy(self, rows):
        given.setdefault(len(rows), []).append(rows)
        original(self, rows)

    monkeypatch.setattr(RouteLog, "set_prefix", spy)
    engine = _engine(num_kv_blocks=256)
    outs = engine.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=2,
                                                       ignore_eos=True))
    for prompt in PROMPTS[:2]:
        arrays = given[len(prompt)]
        assert len(arrays) == 3 and all(a is arrays[0] for a in arrays)
    for i, prompt in enumerate(PROMPTS[:2]):
        mine = [c.routes[: len(prompt)] for c in outs if c.prompt_index == i]
        assert all(np.array_equal(m, mine[0]) for m in mine)
    _check(engine, outs)


def test_preempted_sequences_keep_their_recomputed_routes():
    """A cache of 12 blocks of 4 tokens cannot hold the batch: sequences are preempted and
    recomputed from prompt + generated tokens in one prefill, whose rows replace theirs."""
    engine = _engine(num_kv_blocks=12, max_num_seqs=5)
    outs = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=5,
                                                   ignore_eos=True))
    assert engine.stats.preemptions > 0
    _check(engine, outs)


def test_nothing_is_recorded_unless_asked_or_on_a_dense_model():
    params = SamplingParams(n=2, max_new_tokens=4, seed=1)
    off = _engine(record=False, num_kv_blocks=64)
    assert off.runner.routing is None and not off.records_routes
    assert all(layer.mlp.routing is None for layer in off.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert all(c.routes is None for c in off.generate(PROMPTS[:1], params))
    dense = _engine(preset="tiny", num_kv_blocks=64)
    assert not dense.records_routes and all(c.routes is None for c in dense.generate(PROMPTS[:1], params))
    # the same tokens and log-probs as an engine that records
    on = _engine(num_kv_blocks=64)
    a, b = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert [(c.token_ids, c.logprobs) for c in a] == [(c.token_ids, c.logprobs) for c in b]


def test_route_log_grows_and_pads_unknown_positions():
    log = RouteLog(3, 2)
    prefix = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2)
    log.set_prefix(prefix)
    for pos in range(2, 40):
        log.put(pos, np.full((3, 2), pos, dtype=np.int16))
    rows = log.rows(42)
    assert rows.shape == (42, 3, 2) and np.array_equal(rows[:2], prefix)
    assert all((rows[p] == p).all() for p in range(2, 40)) and (rows[40:] == -1).all()
    log.set_prefix(prefix[:1])  # a recompute: its own rows, what came after unknown
    assert np.array_equal(log.rows(3)[:1], prefix[:1]) and (log.rows(3)[1:] == -1).all()
