"""Token sampling with per-request reproducible noise and exact log-probs.

The log-prob returned for a sampled token is ``log softmax(logits / T)[token]`` over the
whole vocabulary, taken *before* top-k / top-p truncation: the quantity the learner
computes from its own logits. Greedy rows (``T == 0``) take the argmax and report the
log-prob under ``softmax(logits)`` (T = 1).

Sampling is a Gumbel-max race: ``token = argmax(logits / T + g)`` with standard Gumbel
noise ``g``, which draws from ``softmax(logits / T)``. The noise is counter-based, not
drawn from a generator: ``g = -log(-log(u))`` with ``u`` from a 32-bit hash of
``(row_seed, token_id)``, and ``row_seed`` a hash of the completion's key (from the
request seed and sample index) and the position being sampled. So a completion's
tokens depend only on its seed, the model and its own tokens, never on which other
sequences share the batch, on preemption, or on eager vs CUDA-graph decoding; and a
token keeps its noise whether the full-vocabulary kernel or the top-k path samples it.

Truncation (rows with ``top_k > 0`` or ``top_p < 1``) takes ``torch.topk`` of a bounded
``k`` (``top_k``, or ``EngineConfig.top_p_candidates`` when only top-p is set), keeps
the smallest prefix whose mass reaches ``top_p`` (mass measured under the full
softmax), and runs the race over those candidates: no full-vocabulary sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quarl.rollout.sequence import Sequence

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_TOKEN_MUL = 0x85EBCA6B
_SAMPLE_MUL = 0x27D4EB2F


def hash32(x: int) -> int:
    """lowbias32 on a Python int (the kernels run the same steps on int64 lanes)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def hash32_tensor(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 values in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def completion_key(seed: int, sample_index: int) -> int:
    """32-bit key of the random stream of sample ``sample_index`` of a request."""
    return hash32(hash32(seed & _M32) ^ hash32(seed >> 32) + sample_index * _SAMPLE_MUL)


def row_seed(key: int, position: int) -> int:
    """Seed of the draw of the token at ``position`` of the completion keyed ``key``."""
    return hash32(key ^ ((position * _GOLDEN) & _M32))


def gumbel_noise(row_seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``[R, K]`` float32 for row seeds ``[R, 1]`` and token ids ``[R, K]`` (int64)."""
    h = hash32_tensor((row_seeds + token_ids * _TOKEN_MUL) & _M32)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


@dataclass
class SamplingBatch:
    """Per-row sampling inputs (device tensors) and the rows that need truncation."""

    inv_temp: torch.Tensor  # [R] float32: 1/T, or 1 for greedy rows
    row_seed: torch.Tensor  # [R] int64
    noise: torch.Tensor  # [R] float32: 1 to sample, 0 for greedy
    truncated_rows: list[int]
    top_k: list[int]  # per truncated row (<= 0: none)
    top_p: list[float]  # per truncated row


class Sampler:
    """Samples one token per row of logits; returns ``(token_ids [R] int64, logprobs [R] float32)``."""

    def __init__(self, vocab_size: int, device: torch.device, use_triton: bool, top_p_candidates: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.use_triton = use_triton
        self.top_p_candidates = top_p_candidates

    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        inv_temp, seeds, noise, rows, top_k, top_p = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            inv_temp.append(1.0 if p.is_greedy else 1.0 / p.temperature)
            noise.append(0.0 if p.is_greedy else 1.0)
            seeds.append(row_seed(seq.rng_key, len(seq)))
            if p.truncates:
                rows.append(i)
                top_k.append(p.top_k)
                top_p.append(p.top_p)
        dev = self.device
        return SamplingBatch(
            inv_temp=torch.tensor(inv_temp, dtype=torch.float32).to(dev, non_blocking=True),
            row_seed=torch.tensor(seeds, dtype=torch.int64).to(dev, non_blocking=True),
            noise=torch.tensor(noise, dtype=torch.float32).to(dev, non_blocking=True),
            truncated_rows=rows,
            top_k=top_k,
            top_p=top_p,
        )

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """logits ``[R, V]`` (any float dtype)."""
        if self.use_triton:
            from quarl.rollout.kernels import gumbel_sample

            r = logits.shape[0]
            tokens = torch.empty(r, dtype=torch.int64, device=logits.device)
            logprobs = torch.empty(r, dtype=torch.float32, device=logits.device)
            lse = torch.empty(r, dtype=torch.float32, device=logits.device)
            gumbel_sample(logits, batch.inv_temp, batch.row_seed, batch.noise, tokens, logprobs, lse)
        else:
            tokens, logprobs, lse = sample_reference(logits, batch.inv_temp, batch.row_seed, batch.noise)
        if batch.truncated_rows:
            self._sample_truncated(logits, batch, tokens, logprobs, lse)
        return tokens, logprobs

    def _sample_truncated(
        self, logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor, logprobs: torch.Tensor, lse: torch.Tensor
    ) -> None:
        rows = torch.tensor(batch.truncated_rows, device=logits.device)
        x = logits.index_select(0, rows).float() * batch.inv_temp[rows, None]
        caps = [k if k > 0 else self.top_p_candidates for k in batch.top_k]
        kmax = min(self.vocab_size, max(caps))
        vals, idx = torch.topk(x, kmax, dim=-1)  # sorted, descending
        row_lse = lse[rows]
        probs = torch.exp(vals - row_lse[:, None])
        rank = torch.arange(kmax, device=x.device)
        k_row = torch.tensor([min(c, kmax) for c in caps], device=x.device)
        p_row = torch.tensor(batch.top_p, dtype=torch.float32, device=x.device)
        keep = (rank[None, :] < k_row[:, None]) & ((torch.cumsum(probs, -1) - probs) < p_row[:, None])
        key = vals + gumbel_noise(batch.row_seed[rows, None], idx)
        choice = torch.where(keep, key, float("-inf")).argmax(-1, keepdim=True)
        tokens[rows] = idx.gather(1, choice)[:, 0]
        logprobs[rows] = vals.gather(1, choice)[:, 0] - row_lse


def sample_reference(
    logits: torch.Tensor, inv_temp: torch.Tensor, row_seeds: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocabulary Gumbel-max in torch: ``(tokens [R], logprobs [R], lse [R])``."""
    x = logits.float() * inv_temp[:, None]
    lse = torch.logsumexp(x, dim=-1)
    cols = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    key = x + gumbel_noise(row_seeds[:, None], cols[None, :]) * noise[:, None]
    tokens = key.argmax(-1)
    logprobs = x.gather(1, tokens[:, None])[:, 0] - lse
    return tokens, logprobs, lse
