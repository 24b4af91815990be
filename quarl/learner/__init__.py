"""The learner: chunked log-probs, the policy update with gradient accumulation, optimizers."""

from quarl.learner.batch import RolloutBatch, build_batch, split_by_token_budget
from quarl.learner.learner import Critic, Learner, UpdateSettings
from quarl.learner.logprobs import sequence_logprobs, token_logprobs
from quarl.learner.optim import build_optimizer

__all__ = [
    "Critic",
    "Learner",
    "RolloutBatch",
    "UpdateSettings",
    "build_batch",
    "build_optimizer",
    "sequence_logprobs",
    "split_by_token_budget",
    "token_logprobs",
]
