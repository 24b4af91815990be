"""Exact mode's runtime check: where the sampler's and the learner's log-probs part.

In exact mode (``quant.exact``) every step's ``mismatch/max_abs_logp_diff`` must be 0: the
engine and the learner run the same batch-invariant kernels on the same weights. A non-zero
value is a bug (a kernel whose order depends on the batch after all, weights published
wrong), and the user is told where it shows:

* :func:`first_parting`: the first response token (row-major over this rank's batch) whose two
  log-probs differ, with both values;
* :func:`parting_layer` (the first time a run parts): the sequence up to that token run once
  more by the engine (a prefill through its paged cache) and by the learner, with a hook on
  the embedding and on every decoder layer of both models; the first of them whose output
  differs at a position up to the token names where the two forwards part. Both run the
  weights of the moment (after the step's update), and a prefill, not the decode that
  sampled the token: if every layer agrees there, the decode path (or the weights before the
  update) is where they differed.
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


class _Capture:
    """Forward hooks that keep the output of ``modules`` (a tensor, or a layer's ``(h, residual)``)
    of the next forward, each on the CPU in float32 with its row dimension dropped."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.outputs: list[list[torch.Tensor] | None] = [None] * len(modules)
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i: int):
        def keep(module, args, out):
            outs = out if isinstance(out, tuple) else (out,)
            self.outputs[i] = [o.detach().float().reshape(-1, o.shape[-1]).cpu() for o in outs
                               if isinstance(o, torch.Tensor)]
        return keep

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _stages(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    names = ["the embedding"] + [f"decoder layer {i}" for i in range(len(model.layers))]
    return names, [model.embed_tokens, *model.layers]


@torch.no_grad()
def parting_layer(engine, model: nn.Module, token_ids: list[int], position: int) -> str:
    """Where the engine's prefill of ``token_ids[: position + 2]`` and the learner's forward of
    it first part (module doc): ``"decoder layer 3 (first at position 7, max |diff| 0.0039)"``,
    or a sentence saying that every stage agrees. ``engine`` idle with its KV cache allocated;
    ``model`` the learner's (exact mode)."""
    from quarl.learner.logprobs import sequence_logprobs

    ids = list(token_ids[: position + 2])
    names, ours = _stages(model)
    _, theirs = _stages(engine.model)
    learner_cap, engine_cap = _Capture(ours), _Capture(theirs)
    try:
        ref = sequence_logprobs(model, torch.tensor([ids], device=next(model.parameters()).device))[0][0]
        engine.check_logprobs(ids, ref.cpu())
    finally:
        learner_cap.remove()
        engine_cap.remove()
    for name, a, b in zip(names, learner_cap.outputs, engine_cap.outputs):
        if a is None or b is None:
            continue
        for x, y in zip(a, b):
            n = min(len(x), len(y), position + 1)
            if not torch.equal(x[:n], y[:n]):
                at = int((x[:n] != y[:n]).any(-1).nonzero()[0])
                return f"{name} (first at position {at}, max |diff| {float((x[:n] - y[:n]).abs().max()):.3g})"
    return ("no stage: the engine's prefill of that sequence equals the learner's forward at every layer, so the "
            "two parted in the engine's decode path or on the weights before this step's update")


def exact_warning(step: int, max_diff: float, parting: Parting | None, layer: str | None) -> str:
    """The warning of an exact-mode step whose log-probs parted."""
    where = parting.describe() if parting is not None else "on another rank's responses"
    msg = (f"step {step}: quant.exact=true, yet the sampler's and the learner's log-probs differ "
           f"(mismatch/max_abs_logp_diff = {max_diff:.3g}); first at {where}")
    if layer is not None:
        msg += f"; the forwards part at {layer}"
    return msg + ". Exact mode should give 0: please report it with the run's config."
