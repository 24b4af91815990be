"""The supervised warm start on a GPU repeats bit for bit: a suite's runs all start from its
weights, so a second build of the same recipe must give the same base."""

from __future__ import annotations

import random

import torch

from quarl.model.presets import build_random_model
from quarl.trainer.warmstart import supervised_finetune


def _warm_start(pairs):
    model = build_random_model("tiny", seed=0, dtype=torch.float32, device=torch.device("cuda"))
    losses = supervised_finetune(model, pairs, 40, 3e-3, batch_size=16, seed=1, heldout=pairs[:8], eval_every=20)
    return model.state_dict(), losses


def test_the_warm_start_on_the_gpu_gives_the_same_weights_twice():
    rng = random.Random(0)
    vocab = build_random_model("tiny", seed=0, dtype=torch.float32).config.vocab_size
    # prompts and answers of uneven lengths: right-padded batches, attention's backward over many rows
    pairs = [([rng.randrange(3, vocab) for _ in range(rng.randint(4, 40))],
              [rng.randrange(3, vocab) for _ in range(rng.randint(8, 120))]) for _ in range(64)]
    (a, la), (b, lb) = _warm_start(pairs), _warm_start(pairs)
    assert la == lb and la[-1] < la[0]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back
