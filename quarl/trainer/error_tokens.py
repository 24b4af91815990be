"""A step's error tokens (:mod:`quarl.algos.errors`) as the trainer logs them.

The detectors run on the learner's batch layout (``[B, T-1]``: column ``t`` holds the
log-probs of ``input_ids[:, t + 1]``, so the token ids beside them are ``input_ids[:, 1:]``);
a start there is a column, and ``start - first response column`` is the token's index in
the completion's ``token_ids``. This module turns the starts into what the log holds:

- ``samples.jsonl`` rows of up to :data:`FLAGGED_PER_STEP` flagged training responses a step,
  marked ``"flagged": true`` with ``error_kind`` (``"loop"`` / ``"garbled"``), ``error_pos``
  (the first bad token's index in the response), ``response_tokens`` and ``error_text``
  (the completion decoded as ``[before, the bad token, after]``);
- ``error_kind`` / ``error_pos`` of the evaluation samples: loops only (greedy evaluation
  computes no learner log-probs, which the garbled-stretch test needs); null when none.
"""

from __future__ import annotations

from itertools import chain, zip_longest
from typing import Any

import torch

from quarl.algos.errors import garbled_starts, loop_starts

FLAGGED_PER_STEP = 2  # flagged responses logged a step (at most trainer.log_samples)


def error_rows(input_ids: torch.Tensor, learner_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
               algo: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's first loop token and first garbled token (``[B]``, ``T`` where none) in
    a batch's layout (``input_ids`` ``[B, T]``, the rest ``[B, T-1]``); ``algo``: the run's
    ``AlgoConfig`` (the garbled-stretch thresholds ``error_*``)."""
    loops = loop_starts(input_ids[:, 1:], mask)  # (token t + 1 beside the log-probs of column t)
    garbled = garbled_starts(learner_logp, sampler_logp, mask, surprise=algo.error_surprise,
                             gap=algo.error_gap, window=algo.error_window, min_bad=algo.error_min_bad)
    return loops, garbled


def response_columns(attention_mask: torch.Tensor, prompt_lengths: list[int]) -> torch.Tensor:
    """``[B, T-1]`` float: 1 where column ``t`` predicts a response token (``input_ids[:, t+1]``
    is generated), the layout of ``RolloutBatch.response_mask`` before any row is dropped
    (overlong filtering zeroes the rows of truncated responses, whose loops still count)."""
    cols = torch.arange(attention_mask.shape[1] - 1, device=attention_mask.device)
    prompt = torch.tensor(prompt_lengths, dtype=torch.long, device=attention_mask.device)
    return ((cols >= prompt[:, None] - 1) & (attention_mask[:, 1:] > 0)).float()


def flagged_rows(loops: list[int], garbled: list[int], first: list[int], end: list[int],
                 limit: int) -> list[tuple[int, int, str]]:
    """Up to ``limit`` flagged rows as ``(row, error_pos, kind)``, ``error_pos`` the earlier
    start's index in the response (``kind`` is ``"loop"`` on a tie). The two kinds take turns,
    garbled first, each in row order, so a step with both shows both."""
    by_kind: dict[str, list[tuple[int, int, str]]] = {"garbled": [], "loop": []}
    for row, (lo, ga, f, e) in enumerate(zip(loops, garbled, first, end)):
        lo, ga = (lo if f <= lo < e else e), (ga if f <= ga < e else e)
        if min(lo, ga) < e:
            kind = "loop" if lo <= ga else "garbled"
            by_kind[kind].append((row, min(lo, ga) - f, kind))
    turns = chain.from_iterable(zip_longest(by_kind["garbled"], by_kind["loop"]))
    return [r for r in turns if r is not None][:limit]


def flagged_sample(tokenizer, prompt: list[int], tokens: list[int], answer: Any, reward: float, pos: int,
                   kind: str) -> dict[str, Any]:
    """A ``samples.jsonl`` row of a flagged response whose first bad token is ``tokens[pos]``."""
    return {
        "prompt": tokenizer.decode(prompt), "completion": tokenizer.decode(tokens), "answer": answer,
        "reward": reward, "flagged": True, "error_kind": kind, "error_pos": pos, "response_tokens": len(tokens),
        "error_text": [tokenizer.decode(tokens[:pos]),
                       tokenizer.decode(tokens[pos : pos + 1], skip_special_tokens=False),
                       tokenizer.decode(tokens[pos + 1 :])],
    }


def loop_fields(responses: list[list[int]]) -> list[dict[str, Any]]:
    """``error_kind`` / ``error_pos`` of each response's looping tail (both None without one)."""
    if not responses:
        return []
    width = max(max(len(r) for r in responses), 1)
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    mask = torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1.0
    starts = loop_starts(ids, mask).tolist()
    return [{"error_kind": "loop", "error_pos": s} if s < len(r) else {"error_kind": None, "error_pos": None}
            for s, r in zip(starts, responses)]
