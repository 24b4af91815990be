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

Exact mode (``exact=True``): the reported log-probs come from the batch-invariant
log-softmax (:func:`quarl.quant.kernels.invariant_softmax.invariant_token_logprobs`, each
row's ``1 / T``), the kernel the learner's recomputation runs, on logits the invariant LM
head made; the tokens are drawn as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def row_seeds(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Vectorised :func:`row_seed`: uint64 arrays in, int64 array out."""
    x = (keys ^ ((positions.astype(np.uint64) * np.uint64(_GOLDEN)) & np.uint64(_M32))) & np.uint64(_M32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(_M32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(_M32)
    x ^= x >> np.uint64(16)
    return x.astype(np.int64)


@dataclass
class SamplingRows:
    """Per-row sampling settings of a batch whose membership did not change."""

    inv_temp: torch.Tensor  # [R] float32 on device: 1/T, or 1 for greedy rows
    noise: torch.Tensor  # [R] float32 on device: 1 to sample, 0 for greedy
    keys: np.ndarray  # [R] uint64 completion keys
    truncated_rows: list[int]
    top_k: list[int]  # per truncated row (<= 0: none)
    top_p: list[float]  # per truncated row


@dataclass
class SamplingBatch:
    rows: SamplingRows
    row_seed: torch.Tensor  # [R] int64 on device


class Sampler:
    """Samples one token per row of logits; returns ``(token_ids [R] int64, logprobs [R] float32)``."""

    def __init__(self, vocab_size: int, device: torch.device, use_triton: bool, top_p_candidates: int,
                 exact: bool = False) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.use_triton = use_triton
        self.top_p_candidates = top_p_candidates
        self.exact = exact
        self._rows_key: tuple[int, ...] = ()
        self._rows: SamplingRows | None = None

    def rows_for(self, seqs: list[Sequence]) -> SamplingRows:
        """Settings of ``seqs`` (cached while the batch keeps the same sequences)."""
        key = tuple(s.seq_id for s in seqs)
        if self._rows is not None and key == self._rows_key:
            return self._rows
        inv_temp, noise, rows, top_k, top_p = [], [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            inv_temp.append(1.0 if p.is_greedy else 1.0 / p.temperature)
            noise.append(0.0 if p.is_greedy else 1.0)
            if p.truncates:
                rows.append(i)
                top_k.append(p.top_k)
                top_p.append(p.top_p)
        self._rows_key = key
        self._rows = SamplingRows(
            inv_temp=torch.tensor(inv_temp, dtype=torch.float32).to(self.device),
            noise=torch.tensor(noise, dtype=torch.float32).to(self.device),
            keys=np.fromiter((s.rng_key for s in seqs), dtype=np.uint64, count=len(seqs)),
            truncated_rows=rows,
            top_k=top_k,
            top_p=top_p,
        )
        return self._rows

    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        """Sampling inputs for drawing token ``len(seq)`` of each sequence."""
        rows = self.rows_for(seqs)
        positions = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        return SamplingBatch(rows, torch.from_numpy(row_seeds(rows.keys, positions)).to(self.device))

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits ``[R, V]`` (any float dtype); ``out`` optional (tokens, logprobs) buffers,
        which then hold the result (the engine feeds the tokens back as the next input ids)."""
        rows = batch.rows
        if self.use_triton:
            from quarl.rollout.kernels import gumbel_sample

            r = logits.shape[0]
            if out is None:
                out = (
                    torch.empty(r, dtype=torch.int64, device=logits.device),
                    torch.empty(r, dtype=torch.float32, device=logits.device),
                )
            tokens, logprobs = out
            lse = torch.empty(r, dtype=torch.float32, device=logits.device)
            gumbel_sample(logits, rows.inv_temp, batch.row_seed, rows.noise, tokens, logprobs, lse)
        else:
            tokens, logprobs, lse = sample_reference(logits, rows.inv_temp, batch.row_seed, rows.noise)
            if out is not None:
                out[0].copy_(tokens)
                out[1].copy_(logprobs)
                tokens, logprobs = out
        if rows.truncated_rows:
            self._sample_truncated(logits, batch, tokens, logprobs, lse)
        if self.exact:  # (of the full softmax, truncated rows too: what the learner recomputes)
            from quarl.quant.kernels.invariant_softmax import invariant_token_logprobs

            logprobs.copy_(invariant_token_logprobs(logits, tokens, rows.inv_temp)[0])
        return tokens, logprobs

    def _sample_truncated(
        self, logits: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor, logprobs: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        settings = batch.rows
        rows = torch.tensor(settings.truncated_rows, device=logits.device)
        x = logits.index_select(0, rows).float() * settings.inv_temp[rows, None]
        caps = [k if k > 0 else self.top_p_candidates for k in settings.top_k]
        kmax = min(self.vocab_size, max(caps))
        vals, idx = torch.topk(x, kmax, dim=-1)  # sorted, descending
        row_lse = lse[rows]
        probs = torch.exp(vals - row_lse[:, None])
        rank = torch.arange(kmax, device=x.device)
        k_row = torch.tensor([min(c, kmax) for c in caps], device=x.device)
        p_row = torch.tensor(settings.top_p, dtype=torch.float32, device=x.device)
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
