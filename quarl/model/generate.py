"""A simple KV-cached decoder over a left-padded batch.

This is the reference decoding path: one contiguous cache per layer, SDPA with a
padding mask, sampling with a full sort. It is short enough to check by eye and is
used for parity tests and ``quarl generate``; the rollout engine
(:mod:`quarl.rollout`) is the fast path for training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quarl.model.transformer import Transformer


@dataclass
class SimpleOutput:
    token_ids: list[list[int]]  # generated tokens per prompt (prompt excluded)
    logprobs: list[list[float]]  # log-prob of each generated token under softmax(logits / T)
    finish_reasons: list[str]  # "stop" or "length"


class _ContiguousCache:
    """k/v ``[B, Hkv, S, D]`` per layer plus a mask of which slots hold real tokens."""

    def __init__(self, model: Transformer, batch: int, max_len: int, device, dtype) -> None:
        cfg = model.config
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.start = 0  # first slot written by the current forward
        self.length = 0  # slots in use after the current forward

    def attn(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[1]
        s0, s1 = self.start, self.start + t
        self.k[layer_idx][:, :, s0:s1] = k.transpose(1, 2)
        self.v[layer_idx][:, :, s0:s1] = v.transpose(1, 2)
        keys = torch.arange(s1, device=q.device)
        causal = keys[None, :] <= (s0 + torch.arange(t, device=q.device))[:, None]
        mask = causal[None] & self.valid[:, None, :s1]
        mask = mask | (keys[None, None, :] == (s0 + torch.arange(t, device=q.device))[None, :, None])
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            self.k[layer_idx][:, :, :s1],
            self.v[layer_idx][:, :, :s1],
            attn_mask=mask[:, None],
            enable_gqa=True,
        )
        return out.transpose(1, 2)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample from ``logits [B, V]``; returns tokens ``[B]`` and their log-probs.

    The log-prob is taken under ``softmax(logits / temperature)`` before top-k/top-p
    truncation, the quantity the learner recomputes. ``temperature == 0`` is greedy
    (log-probs then under the untempered softmax).
    """
    logits = logits.float()
    if temperature <= 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp_all = torch.log_softmax(scaled, -1)
    filtered = scaled.clone()
    if top_k and top_k > 0:
        kth = torch.topk(filtered, min(top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
        filtered[filtered < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(filtered, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p
        sorted_logits[drop] = float("-inf")
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = torch.softmax(filtered, -1)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


@torch.no_grad()
def generate_simple(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    seed: int | None = None,
) -> SimpleOutput:
    """Decode ``max_new_tokens`` after each prompt (batched, left-padded)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_simple needs at least one prompt and no empty prompt")
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    b, plen = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, plen, dtype=torch.long, device=device)
    cache = _ContiguousCache(model, b, plen + max_new_tokens, device, dtype)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
        cache.valid[i, plen - len(p) : plen] = True
    positions = (cache.valid[:, :plen].long().cumsum(-1) - 1).clamp(min=0)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    stop = set(int(t) for t in stop_token_ids)
    out_tok: list[list[int]] = [[] for _ in range(b)]
    out_lp: list[list[float]] = [[] for _ in range(b)]
    done = [False] * b
    reasons = ["length"] * b
    cache.start = 0
    for step in range(max_new_tokens):
        hidden = model.hidden_states(ids, positions, cache.attn)[:, -1]
        tok, lp = sample_next(model.logits(hidden), temperature, top_p, top_k, gen)
        for i in range(b):
            if done[i]:
                continue
            t = int(tok[i])
            out_tok[i].append(t)
            out_lp[i].append(float(lp[i]))
            if t in stop:
                done[i], reasons[i] = True, "stop"
        if all(done):
            break
        cache.start += ids.shape[1]
        cache.valid[:, cache.start] = True
        ids = tok[:, None]
        positions = positions[:, -1:] + 1
    return SimpleOutput(out_tok, out_lp, reasons)
