"""Per-token KL estimators against a reference policy (Schulman 2020, "Approximating KL").

With ``d = ref_logp - logp`` on tokens sampled from the current policy:

- ``k1`` ``-d``                 unbiased, high variance, can be negative.
- ``k2`` ``d^2 / 2``            biased, low variance.
- ``k3`` ``exp(d) - d - 1``     unbiased and >= 0 (GRPO's choice; QuRL section 3).

The penalty is added to the policy loss and reduced with the same ``agg_loss``; the
gradient flows through ``logp`` only.
"""

from __future__ import annotations

import torch

from quarl.algos.aggregation import _masked

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` of ``kind`` in :data:`KL_ESTIMATORS`.

    ``logp``, ``ref_logp`` (and the optional ``mask``): ``[B, T]``; with a mask the result
    is exactly 0 off it, whatever the padding holds.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    d = ref_logp.detach() - logp
    if mask is not None:
        d = _masked(d, mask)
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.expm1(d) - d
    return kl if mask is None else kl * mask.to(kl.dtype)
