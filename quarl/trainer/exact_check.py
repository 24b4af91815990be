"""Exact mode's runtime check: where the sampler's and the learner's log-probs part.

In exact mode (``quant.exact``) every step's ``mismatch/max_abs_logp_diff`` must be 0: the
engine and the learner run the same batch-invariant kernels on the same weights. A non-zero
value is a bug (a kernel whose order depends on the batch after all, weights published
wrong), and the user is told where it shows:

* :func:`first_parting`: the first response token (row-major over this rank's batch) whose two
  log-probs differ, with both values;
* :func:`parting_layer` (the first time a run parts): the sequence up to that token run once
  more by the engine (a prefill through its paged cache) and by the learner, with a hook on
  every decoder layer of both models (:mod:`quarl.rollout.parity`, as the start-up check);
  the first layer whose residual stream differs names where the two forwards part. Both run
  the weights of the moment (after the step's update), and a prefill, not the decode that
  sampled the token: if every layer agrees there, the decode path, the LM head (or the
  weights before the update) is where they differed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Parting:
    """The first response token whose sampler and learner log-probs differ: its ``row`` in the
    batch, its ``position`` in that row (the log-prob of ``input_ids[row, position + 1]``),
    the ``token`` and the two log-probs."""

    row: int
    position: int
    token: int
    learner: float
    sampler: float

    def describe(self) -> str:
        return (f"response {self.row}, the token at position {self.position + 1} (id {self.token}): learner "
                f"log-prob {self.learner!r}, sampler {self.sampler!r}")


def first_parting(input_ids: torch.Tensor, learner_logp: torch.Tensor, sampler_logp: torch.Tensor,
                  mask: torch.Tensor) -> Parting | None:
    """The first (row-major) response token of ``[B, T-1]`` log-probs whose two values are not
    bit-equal (None: all equal). ``input_ids [B, T]``; ``mask`` marks the response tokens."""
    differ = (learner_logp.detach().float() != sampler_logp.detach().float()) & mask.bool()
    hits = differ.nonzero()
    if hits.numel() == 0:
        return None
    row, pos = (int(v) for v in hits[0])
    return Parting(row, pos, int(input_ids[row, pos + 1]), float(learner_logp[row, pos]),
                   float(sampler_logp[row, pos]))


@torch.no_grad()
def parting_layer(engine, model: nn.Module, token_ids: list[int], position: int) -> str:
    """Where the engine's prefill of ``token_ids[: position + 2]`` and the learner's forward of
    it first part (module doc; the residual streams of :func:`quarl.rollout.parity.layer_streams`
    compared bit for bit): ``"layers.3 (token 7 differs most there, by 2.1e-03 of its norm)"``, or a
    sentence saying that every layer agrees. ``engine`` idle with its KV cache allocated;
    ``model`` the learner's (exact mode)."""
    from quarl.learner.logprobs import sequence_logprobs
    from quarl.rollout.parity import layer_streams, locate_parting

    ids = list(token_ids[: position + 2])
    ref: list[torch.Tensor] = []
    x = torch.tensor([ids], device=next(model.parameters()).device)
    learner = layer_streams(model, lambda: ref.append(sequence_logprobs(model, x)[0][0].cpu()))
    served = layer_streams(engine.runner.model, lambda: engine.check_logprobs(ids, ref[0]))
    p = locate_parting(served, learner)
    if p.first_layer is None:
        return ("no layer: the engine's prefill of that sequence equals the learner's forward at every layer, so the "
                "two parted in the engine's decode path, its LM head or log-softmax, or on the weights before this "
                "step's update")
    return f"layers.{p.first_layer} (token {p.first_token} differs most there, by {p.first_rel:.1e} of its norm)"


def exact_warning(step: int, max_diff: float, parting: Parting | None, layer: str | None) -> str:
    """The warning of an exact-mode step whose log-probs parted."""
    where = parting.describe() if parting is not None else "on another rank's responses"
    msg = (f"step {step}: quant.exact=true, yet the sampler's and the learner's log-probs differ "
           f"(mismatch/max_abs_logp_diff = {max_diff:.3g}); first at {where}")
    if layer is not None:
        msg += f"; the forwards part at {layer}"
    return msg + ". Exact mode should give 0: please report it with the run's config."
