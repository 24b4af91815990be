"""How far the rollout engine's policy is from the learner's, measured on sampled tokens.

With ``d = old_logp - sampler_logp`` (learner minus sampler, per response token) and the
tokens sampled from the sampler, ``-d`` (k1) and ``exp(d) - d - 1`` (k3) are estimators
of ``KL(pi_sampler || pi_old)`` (QuRL section 4.2 tracks the same quantity). The two
papers' argument rests on mismatch growing along a response (an early error token sends
the rest off-trajectory, QaRL section 3.2), so the KL is also reported by response-length
quartile: q1 holds the shortest quarter of the non-empty responses, q4 the longest
(ranks split as evenly as possible; a quartile with no response reports NaN).
"""

from __future__ import annotations

import torch

from quarl.algos.aggregation import _masked, masked_max, masked_mean, seq_mean
from quarl.algos.losses import floats

_NUM_QUARTILES = 4


def mismatch_metrics(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Sampler/learner mismatch statistics over the response tokens.

    ``old_logp``, ``sampler_logp``, ``mask``: ``[B, T]``. Returns floats:

    - ``mismatch/kl_k1``              token mean of ``-d``
    - ``mismatch/kl_k3``              token mean of ``exp(d) - d - 1``
    - ``mismatch/abs_logp_diff_mean``  token mean of ``|d|``
    - ``mismatch/max_abs_logp_diff``  ``max |d|`` over the response tokens: the check of exact
      mode (``quant.exact``), 0 exactly when every token's two log-probs are equal
    - ``mismatch/ppl_ratio``          learner / sampler perplexity of the sampled tokens,
      ``exp(-mean old_logp) / exp(-mean sampler_logp)`` over all response tokens
    - ``mismatch/seq_w_max``          ``max_i exp(mean_t d)``, the largest sequence weight
    - ``mismatch/kl_k1_q{1..4}``, ``mismatch/kl_k3_q{1..4}``  the KLs per length quartile

    Everything is 0 (quartiles NaN) when there are no response tokens.
    """
    if not (old_logp.shape == sampler_logp.shape == mask.shape) or old_logp.dim() != 2:
        raise ValueError(
            "old_logp, sampler_logp and mask must all be [B, T]; got "
            f"{tuple(old_logp.shape)}, {tuple(sampler_logp.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        old = old_logp.detach().double()
        sampler = sampler_logp.detach().double()
        m = mask.detach().double()
        d = _masked(old - sampler, m)
        k1 = -d
        k3 = torch.expm1(d) - d
        abs_d = d.abs()
        lengths = m.sum(-1)
        valid = lengths > 0
        seq_w = torch.exp(seq_mean(d, m))
        learner_nll = -masked_mean(_masked(old, m), m)
        sampler_nll = -masked_mean(_masked(sampler, m), m)
        metrics = {
            "mismatch/kl_k1": masked_mean(k1, m),
            "mismatch/kl_k3": masked_mean(k3, m),
            "mismatch/abs_logp_diff_mean": masked_mean(abs_d, m),
            "mismatch/max_abs_logp_diff": masked_max(abs_d, m > 0),
            "mismatch/ppl_ratio": torch.exp(learner_nll - sampler_nll),
            "mismatch/seq_w_max": masked_max(seq_w, valid),
        }
        metrics.update(_by_length_quartile({"kl_k1": k1, "kl_k3": k3}, m, lengths))
    return floats(metrics)


def _by_length_quartile(
    per_token: dict[str, torch.Tensor], mask: torch.Tensor, lengths: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Token means of each ``[B, T]`` tensor within each response-length quartile."""
    order = torch.argsort(lengths, stable=True)
    order = order[lengths[order] > 0]
    chunks = torch.tensor_split(order, _NUM_QUARTILES)
    out = {}
    for q, rows in enumerate(chunks, start=1):
        for name, x in per_token.items():
            value = masked_mean(x[rows], mask[rows]) if rows.numel() else x.new_full((), float("nan"))
            out[f"mismatch/{name}_q{q}"] = value
    return out
