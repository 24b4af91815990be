"""Importance corrections for the sampler/learner mismatch.

The rollout engine samples from ``pi_sampler`` (low-bit weights and kernels) while the
policy-gradient estimator needs ``pi_old`` (the learner at the start of the step, the
"proximal" policy of decoupled PPO). The token mismatch weight is

    w = pi_old / pi_sampler = exp(old_logp - sampler_logp)        (always detached)

and each correction turns it into a per-token (or per-response) multiplier of the
surrogate loss:

token level (``ppo``, ``positive_only``, ``sapo``)
    ``none``       1
    ``tis``        min(w, C)                      FlashRL / QuRL eq. 5
    ``decoupled``  w                              Hilton et al. 2022 / QuRL eq. 4
    ``acr``        min(w, C), and the PPO upper clip bound becomes (1 + eps_high) / rho
                   with rho = min(1, C / w)       QuRL eq. 9 (adaptive clipping range)
    ``icepop``     w inside [1/C, C], 0 outside   IcePop: M(w) = w on the band, else 0

sequence level (``gspo``; ``tbpo`` always uses ``seq-tis``)
    ``none``       1
    ``seq-tis``    v = exp(clamp(mean_t(old_logp - sampler_logp), -log C, log C))
                   QaRL eq. 5 (the geometric-mean ratio, two-sided truncation)
    ``mis``        v = exp(mean_t(old_logp - sampler_logp)) unclamped; responses with v
                   outside [1/C, C] are dropped (weight 0), the rest weighted by v

When sampler and learner agree (``old_logp == sampler_logp``) every weight is exactly 1
and every ACR bound equals the plain PPO bound.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from quarl.algos.aggregation import _masked, seq_mean

TOKEN_CORRECTIONS: tuple[str, ...] = ("none", "tis", "decoupled", "acr", "icepop")
SEQ_CORRECTIONS: tuple[str, ...] = ("none", "seq-tis", "mis")


class TokenCorrection(NamedTuple):
    """``weight [B, T]`` multiplies the per-token loss; ``upper_scale [B, T]`` multiplies
    the PPO upper clip bound ``1 + eps_high`` (1 everywhere except under ACR);
    ``dropped [B, T]`` marks tokens a correction removed (IcePop)."""

    weight: torch.Tensor
    upper_scale: torch.Tensor
    dropped: torch.Tensor


class SeqCorrection(NamedTuple):
    """``weight [B]`` multiplies each response's loss; ``dropped [B]`` marks responses
    a correction removed (MIS)."""

    weight: torch.Tensor
    dropped: torch.Tensor


def check_cap(cap: float) -> None:
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")


def mismatch_log_weight(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log w = old_logp - sampler_logp`` ``[B, T]``, detached, exactly 0 off the mask."""
    return _masked((old_logp - sampler_logp).detach(), mask)


def token_correction(
    correction: str,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> TokenCorrection:
    """Per-token weights of the correction named ``correction`` (module docstring).

    ``old_logp``, ``sampler_logp``, ``mask``: ``[B, T]``. Returns detached tensors.
    """
    if correction not in TOKEN_CORRECTIONS:
        raise ValueError(
            f"unknown token-level correction {correction!r}; valid: {', '.join(TOKEN_CORRECTIONS)}"
        )
    check_cap(cap)
    w = torch.exp(mismatch_log_weight(old_logp, sampler_logp, mask))
    ones = torch.ones_like(w)
    no_drop = torch.zeros_like(w, dtype=torch.bool)
    if correction == "none":
        return TokenCorrection(ones, ones, no_drop)
    if correction == "decoupled":
        return TokenCorrection(w, ones, no_drop)
    truncated = w.clamp(max=cap)
    if correction == "tis":
        return TokenCorrection(truncated, ones, no_drop)
    if correction == "acr":
        # (1 + eps_high) / rho with rho = min(1, C / w)  ==  (1 + eps_high) * max(1, w / C)
        return TokenCorrection(truncated, (w / cap).clamp(min=1.0), no_drop)
    in_band = (w >= 1.0 / cap) & (w <= cap)
    dropped = ~in_band & mask.bool()
    return TokenCorrection(torch.where(in_band, w, torch.zeros_like(w)), ones, dropped)


def seq_log_weight(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log v = mean_t(old_logp - sampler_logp)`` per response: ``[B, T] -> [B]``, detached."""
    return seq_mean(mismatch_log_weight(old_logp, sampler_logp, mask), mask)


def seq_tis_weight(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """QaRL eq. 5: ``v = exp(clamp(mean_t(old_logp - sampler_logp), -log c, log c))`` ``[B]``."""
    check_cap(cap)
    log_cap = math.log(cap)
    return torch.exp(seq_log_weight(old_logp, sampler_logp, mask).clamp(-log_cap, log_cap))


def seq_correction(
    correction: str,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> SeqCorrection:
    """Per-response weights ``[B]`` of a sequence-level correction (module docstring)."""
    if correction not in SEQ_CORRECTIONS:
        raise ValueError(
            f"unknown sequence-level correction {correction!r}; valid: {', '.join(SEQ_CORRECTIONS)}"
        )
    check_cap(cap)
    batch = old_logp.shape[0]
    no_drop = torch.zeros(batch, dtype=torch.bool, device=old_logp.device)
    if correction == "none":
        return SeqCorrection(torch.ones(batch, dtype=old_logp.dtype, device=old_logp.device), no_drop)
    if correction == "seq-tis":
        return SeqCorrection(seq_tis_weight(old_logp, sampler_logp, mask, cap), no_drop)
    v = torch.exp(seq_log_weight(old_logp, sampler_logp, mask))
    in_band = (v >= 1.0 / cap) & (v <= cap)
    return SeqCorrection(torch.where(in_band, v, torch.zeros_like(v)), ~in_band)
