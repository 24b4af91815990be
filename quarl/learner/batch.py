"""The learner's view of a rollout: padded token tensors with the sampler's numbers.

Shapes (B responses, T = longest prompt + response):
- ``input_ids [B, T]`` prompt then response, right-padded with 0;
- ``attention_mask [B, T]`` 1 on real tokens;
- ``response_mask [B, T-1]`` 1 where position t predicts a response token
  (``input_ids[:, t+1]`` is generated), the layout of
  :func:`quarl.learner.logprobs.sequence_logprobs`;
- ``sampler_logp [B, T-1]`` the engine's log-probs of those tokens (0 elsewhere);
- ``advantages [B]`` (or ``[B, T-1]`` from GAE), ``rewards [B]``;
- ``routes [B, T, L, k]`` int16 (an MoE model whose engine recorded them, else None): the
  experts each token ran in the engine's ``L`` MoE layers, ``-1`` where unknown (padding, a
  response's last token). It stays in host memory (``to`` leaves it there: 2 L k bytes a
  token, 768 on Qwen3-30B-A3B, ~100x the other per-token fields); each forward moves its
  micro-batch's rows to the device (:meth:`quarl.learner.Learner.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    sampler_logp: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [B, T, moe layers, k] int16, on the host (module docstring)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to(self, device: torch.device) -> "RolloutBatch":
        """The batch on ``device``, but for :attr:`routes` (kept on the host)."""
        return RolloutBatch(**{f.name: getattr(self, f.name) if f.name == "routes" else
                               _to(getattr(self, f.name), device) for f in fields(self)})

    def rows(self, mb: "MicroBatch") -> "RolloutBatch":
        """Rows ``mb.lo:mb.hi`` trimmed to ``mb.width`` tokens: views, no device sync."""
        return self._take(slice(mb.lo, mb.hi), mb.width)

    def longest_first(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` reordered by decreasing sequence length (ties keep their order), on the
        device: cut into consecutive micro-batches, rows of like length then share one, so a
        micro-batch pads little (the largest first, so the learner's peak memory shows at once)."""
        lengths = self.attention_mask[rows].sum(-1)
        return rows[torch.argsort(lengths, descending=True, stable=True)]

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        """Rows ``idx``, trimmed to their longest sequence."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        return self._take(idx, int(self.attention_mask[idx].sum(-1).max()))

    def _take(self, rows: slice | torch.Tensor, width: int) -> "RolloutBatch":
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name == "routes":  # (on the host: so are the rows it takes)
                host_rows = rows if isinstance(rows, slice) else rows.cpu()
                out[f.name] = v[host_rows, :width]
            elif v.dim() == 2:
                out[f.name] = v[rows, : width if v.shape[1] == self.input_ids.shape[1] else width - 1]
            else:
                out[f.name] = v[rows]
        return RolloutBatch(**out)


def _to(v, device):
    return None if v is None else v.to(device)


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    sampler_logprobs: list[list[float]],
    rewards: list[float],
    advantages: torch.Tensor,
    routes: list[np.ndarray] | None = None,
) -> RolloutBatch:
    """Pack prompt/response pairs (one row each) into a right-padded :class:`RolloutBatch`;
    ``routes``: each row's ``[len(prompt) + len(response), L, k]`` expert ids (the engine's
    ``Completion.routes``), padded with -1."""
    b = len(responses)
    t = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    resp = torch.zeros(b, t - 1)
    slp = torch.zeros(b, t - 1)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, sampler_logprobs)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attn[i, :n] = 1
        if r:
            resp[i, len(p) - 1 : n - 1] = 1.0
            slp[i, len(p) - 1 : n - 1] = torch.tensor(lp, dtype=torch.float32)
    packed_routes = None
    if routes is not None:
        packed_routes = torch.full((b, t, *routes[0].shape[1:]), -1, dtype=torch.int16)
        for i, r in enumerate(routes):
            packed_routes[i, : len(r)] = torch.from_numpy(np.ascontiguousarray(r))
    return RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        sampler_logp=slp,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        advantages=advantages.float(),
        routes=packed_routes,
    )


class MicroBatch(NamedTuple):
    """Rows ``lo:hi`` of a batch, ``width`` its longest row (prompt + response tokens),
    ``response_tokens`` its response-token count, ``longest_response`` its longest
    response, ``tokens`` its real (unpadded) tokens and ``response_rows`` its rows with a
    response token: known on the host, so slicing it
    (:meth:`RolloutBatch.rows`) and weighting its loss need no device sync."""

    lo: int
    hi: int
    width: int
    response_tokens: int
    longest_response: int
    tokens: int
    response_rows: int  # rows with at least one response token (the sequence means' count)

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def padded(self) -> int:
        """Tokens the forward computes: rows x width."""
        return self.size * self.width


class Packing(NamedTuple):
    """How an update's micro-batches used the token budget (one rank's): ``micro_batches`` over
    ``steps`` optimizer steps, ``padded`` the tokens their forwards computed (rows x width),
    ``tokens`` the real ones among them, ``longest`` the longest row."""

    micro_batches: int
    padded: int
    tokens: int
    longest: int
    budget: int
    steps: int = 1

    @classmethod
    def of(cls, parts: list[MicroBatch], token_budget: int) -> "Packing":
        """One mini-batch's micro-batches (one optimizer step)."""
        return cls(len(parts), sum(p.padded for p in parts), sum(p.tokens for p in parts),
                   max((p.width for p in parts), default=0), token_budget)

    def merged(self, other: "Packing") -> "Packing":
        return Packing(self.micro_batches + other.micro_batches, self.padded + other.padded,
                       self.tokens + other.tokens, max(self.longest, other.longest), self.budget,
                       self.steps + other.steps)

    @property
    def fill(self) -> float:
        """Padded tokens over the budget, on average over the micro-batches."""
        return self.padded / max(self.micro_batches * self.budget, 1)

    @property
    def padding(self) -> float:
        """The share of the padded tokens that are padding."""
        return 1.0 - self.tokens / max(self.padded, 1)

    def metrics(self) -> dict[str, float]:
        return {"perf/micro_batches": self.micro_batches / max(self.steps, 1), "perf/micro_batch_fill": self.fill,
                "perf/padding_frac": self.padding}

    def advice(self) -> str | None:
        """What to change when micro-batches hold one row each and use under 60% of the budget:
        the budget that holds two of the longest rows (None when the budget is used)."""
        if self.micro_batches == 0 or self.fill >= 0.6 or 2 * self.longest <= self.budget:
            return None
        return (f"trainer.token_budget={self.budget} holds one row of up to {self.longest} tokens per micro-batch "
                f"({self.fill:.0%} of the budget on average), and the learner pays its host work (Python, kernel "
                f"launches) per micro-batch: --trainer.token_budget={-(-2 * self.longest // 256) * 256} would hold "
                "two where memory allows (memory/learner_peak_gb shows the headroom)")


def budget_ranges(lengths: list[int], token_budget: int) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[lo, hi)`` whose padded size (rows x longest row) fits the
    budget (a row longer than the budget gets a range of its own)."""
    ranges: list[tuple[int, int]] = []
    lo, cur_max = 0, 0
    for i, n in enumerate(lengths):
        new_max = max(cur_max, n)
        if i > lo and new_max * (i - lo + 1) > token_budget:
            ranges.append((lo, i))
            lo, new_max = i, n
        cur_max = new_max
    if lo < len(lengths):
        ranges.append((lo, len(lengths)))
    return ranges


def micro_batches(batch: RolloutBatch, token_budget: int) -> list[MicroBatch]:
    """The batch cut into micro-batches of consecutive rows within ``token_budget`` padded
    tokens, with one host transfer for the whole batch."""
    counts = torch.stack([batch.attention_mask.sum(-1), batch.response_mask.sum(-1).to(batch.attention_mask.dtype)])
    lengths, responses = counts.tolist()
    lengths, responses = [int(n) for n in lengths], [int(n) for n in responses]
    return [MicroBatch(lo, hi, max(max(lengths[lo:hi]), 1), sum(responses[lo:hi]), max(responses[lo:hi]),
                       sum(lengths[lo:hi]), sum(n > 0 for n in responses[lo:hi]))
            for lo, hi in budget_ranges(lengths, token_budget)]


def split_by_token_budget(batch: RolloutBatch, token_budget: int) -> list[torch.Tensor]:
    """Row indices of micro-batches whose padded size (rows x longest row) fits the budget."""
    return [torch.arange(mb.lo, mb.hi, dtype=torch.long) for mb in micro_batches(batch, token_budget)]
