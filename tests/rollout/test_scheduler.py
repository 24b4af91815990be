"""Scheduler lookahead (the next decode step planned while the current one runs)."""

from __future__ import annotations

import pytest
import torch

import quarl
from quarl.rollout import Engine, EngineConfig, SamplingParams
from quarl.rollout.block_manager import BlockManager
from quarl.rollout.scheduler import Scheduler
from quarl.rollout.sequence import Sequence

PROMPTS = [[5, 17, 33], [9] * 12 + [40, 41], [60], [7, 8, 9, 10, 11, 12, 13], list(range(3, 23)), [44, 45]]


def _running(bm: BlockManager, sched: Scheduler, lens: list[int], max_new: int = 8) -> list[Sequence]:
    seqs = []
    for i, n in enumerate(lens):
        s = Sequence(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=max_new), i, 0, i, frozenset())
        sched.add([s])
        seqs.append(s)
    batch = sched.schedule()  # prefill
    for s in batch.seqs:
        s.append(7, -1.0)
    return seqs


def test_lookahead_takes_the_next_steps_blocks_and_schedule_repeats_nothing():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=16), bm, 64)
    seqs = _running(bm, sched, [3, 6])  # lengths 4 and 7 after the prefill's token
    batch = sched.schedule()
    assert not batch.is_prefill and [len(s.block_table) for s in seqs] == [1, 2]
    plan = sched.lookahead(batch)
    # the next step writes position len(seq): 4 -> a second block for seq 0, 7 stays in block 1
    assert plan is not None and plan.seqs == seqs and plan.block_copies == []
    assert [len(s.block_table) for s in seqs] == [2, 2]
    free = bm.num_free_blocks
    for s in seqs:  # the step's tokens arrive; the plan holds, or is dropped and schedule repeats it
        s.append(8, -1.0)
    again = sched.schedule()
    assert again.seqs == seqs and again.block_copies == [] and bm.num_free_blocks == free


def test_lookahead_declines_what_it_cannot_predict():
    bm = BlockManager(num_blocks=16, block_size=4)
    cfg = EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=16)
    sched = Scheduler(cfg, bm, 64)
    _running(bm, sched, [3, 6], max_new=2)
    batch = sched.schedule()
    assert sched.lookahead(batch) is None  # the token of this step is the last one (max_new_tokens = 2)

    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(cfg, bm, 64)
    seqs = _running(bm, sched, [3, 4])  # 1 + 2 blocks: none free
    batch = sched.schedule()  # seq 0 at length 4 writes position 3: its block exists
    assert sched.lookahead(batch) is None and len(seqs[0].block_table) == 1  # position 4 needs a block
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(cfg, bm, 64)
    _running(bm, sched, [3])
    sched.add([Sequence(9, [1, 2], SamplingParams(), 9, 0, 9, frozenset())])
    assert sched.lookahead(sched._schedule_decode()) is None  # a group waits for a prefill


def test_postprocess_gives_a_finished_sequence_no_token():
    """The row a queued step ran for a sequence that stopped at the step ahead: no token is
    appended, the sequence is not reported finished twice and its freed blocks stay free."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=16), bm, 64)
    a, b = _running(bm, sched, [3, 6])
    a.stop_ids = frozenset({5})
    assert sched.postprocess([a, b], [5, 9], [-0.5, -0.25]) == [a]
    free, tokens = bm.num_free_blocks, list(a.token_ids)
    assert sched.postprocess([a, b], [8, 8], [-0.1, -0.2]) == []
    assert a.token_ids == tokens and a.finish_reason == "stop" and bm.num_free_blocks == free
    assert b.token_ids[-3:] == [7, 9, 8] and b.logprobs[-2:] == [-0.25, -0.2]


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    family, path, _ = hf_checkpoint
    model = quarl.load_model(path, dtype=torch.float32)
    make = lambda la, **kw: Engine(model, config=EngineConfig(max_model_len=48, block_size=4, lookahead=la, **kw))  # noqa: E731
    return family, {la: (make(la, num_kv_blocks=256), make(la, num_kv_blocks=14, max_num_seqs=5)) for la in (True,
                                                                                                             False)}


def test_lookahead_gives_the_same_completions(engines):
    """With and without lookahead: the same tokens and finish reasons and the same log-probs
    to float32 rounding, through stop tokens at different steps, length limits, prompt
    sharing with copy-on-write and preemption (the small cache). (With lookahead the step
    queued behind a stop still runs the stopped sequence's row, so that one step's batch
    differs and its GEMMs may round differently.)"""
    family, eng = engines
    probe = eng[False][0].generate(PROMPTS,
                                   SamplingParams(n=2, temperature=1.0, max_new_tokens=14, seed=7, ignore_eos=True))
    counts = torch.bincount(torch.tensor(sum((c.token_ids for c in probe), [])))
    stops = counts.argsort(descending=True)[:2].tolist()  # frequent tokens: sequences stop at various steps
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=6 + 2 * i, seed=11 + i, stop_token_ids=stops)
              for i in range(len(PROMPTS))]
    for which in (0, 1):
        on, off = eng[True][which], eng[False][which]
        a, b = on.generate(PROMPTS, params), off.generate(PROMPTS, params)
        assert [(c.token_ids, c.finish_reason) for c in a] == [(c.token_ids, c.finish_reason) for c in b], family
        for ca, cb in zip(a, b):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), rtol=1e-5, atol=1e-5)
        assert {c.finish_reason for c in a} == {"stop", "length"}
        assert on.stats.planned_steps > 0 and off.stats.planned_steps == 0
        assert on.stats.planned_steps < on.stats.decode_steps  # plans dropped / declined somewhere
        if which == 1:
            assert on.stats.preemptions > 0
        assert on.block_manager.num_free_blocks == on.runner.num_blocks
