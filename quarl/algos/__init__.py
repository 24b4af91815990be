"""Algorithms as pure functions of tensors and scalars (docs/design.md, "Algorithms").

- advantages:   :func:`compute_advantages` (grpo, dr_grpo, rloo), :func:`compute_gae`,
                :func:`last_token_rewards`, :func:`whiten`
- filters:      :func:`informative_groups`, :func:`drop_rows` (DAPO dynamic sampling, overlong)
- policy loss:  :func:`compute_policy_loss` (ppo, positive_only, sapo, gspo, tbpo) with
                mismatch corrections (tis, decoupled, acr, icepop; seq-tis, mis)
- reduction:    :func:`agg_loss`, :func:`masked_mean`, :func:`masked_sum`, :func:`seq_mean`
- KL:           :func:`kl_penalty` (k1, k2, k3)
- metrics:      :func:`mismatch_metrics`, :func:`is_repetitive`, :func:`repeat_fraction`
- error tokens: :func:`loop_starts`, :func:`garbled_starts`, :func:`error_starts` (where a
                response first goes wrong), :func:`before_error` (the mask before it),
                :func:`error_metrics`

Nothing here takes a config object; every name is found in a small registry whose keys
are exported as the tuples below.
"""

from quarl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    compute_gae,
    last_token_rewards,
    whiten,
)
from quarl.algos.aggregation import AGG_MODES, agg_loss, masked_mean, masked_sum, seq_mean
from quarl.algos.errors import before_error, error_metrics, error_starts, garbled_starts, loop_starts
from quarl.algos.filters import drop_rows, informative_groups
from quarl.algos.corrections import SEQ_CORRECTIONS, TOKEN_CORRECTIONS
from quarl.algos.kl import KL_ESTIMATORS, kl_penalty
from quarl.algos.losses import (
    POLICY_LOSSES,
    SEQUENCE_LOSSES,
    compute_policy_loss,
    policy_loss_defaults,
)
from quarl.algos.mismatch import mismatch_metrics
from quarl.algos.repetition import is_repetitive, repeat_fraction

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "SEQUENCE_LOSSES",
    "SEQ_CORRECTIONS",
    "TOKEN_CORRECTIONS",
    "agg_loss",
    "before_error",
    "compute_advantages",
    "compute_gae",
    "compute_policy_loss",
    "drop_rows",
    "error_metrics",
    "error_starts",
    "garbled_starts",
    "informative_groups",
    "is_repetitive",
    "kl_penalty",
    "last_token_rewards",
    "loop_starts",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
    "policy_loss_defaults",
    "repeat_fraction",
    "seq_mean",
    "whiten",
]
