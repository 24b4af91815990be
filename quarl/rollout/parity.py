"""Where the rollout engine and the learner part on one sequence: layer by layer, token by token.

The trainer's start-up check compares the two sides' log-probs of one sequence
(``Trainer._check_engine_sync``); when they disagree, :func:`explain_sync_failure` runs both
again with a hook on every decoder layer, compares their residual streams per token and says
in one line where they part, so that a user (or a bug report) knows the layer and the token
rather than a bare number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# a token's stream "parts" once the two sides differ by this much of its norm (bf16 rounding of a
# layer is ~4e-3 of it, float32 ~1e-7; a code moved by a per-token quantizer or a stale weight more)
PART_REL = 1e-2


class EngineSyncError(ValueError, RuntimeError):
    """Engine and learner disagree after publishing. A ValueError: the CLI prints its one-line
    message (what, where, what to do) without a traceback; a RuntimeError as it always was."""


@dataclass(frozen=True)
class Parting:
    layers: int              # decoder layers compared
    first_layer: int | None  # first layer whose output differs at all (None: every layer's bits agree)
    first_token: int | None  # its token with the largest relative difference
    first_rel: float
    part_layer: int | None   # first layer where a token's stream differs by PART_REL or more of its norm
    part_token: int | None
    part_rel: float
    max_rel: float           # largest relative difference over all layers and tokens


def layer_streams(model: nn.Module, run: Callable[[], Any]) -> list[torch.Tensor]:
    """The residual stream ``[tokens, H]`` (float32, on the CPU) after each decoder layer of
    ``model`` while ``run()`` runs it once over one sequence. (Copied when the layer returns:
    the engine's fused kernels later add into the same tensor in place.)"""
    out: list[torch.Tensor] = []

    def hook(_mod, _args, result):
        stream = result[1]
        out.append(stream.detach().reshape(-1, stream.shape[-1]).float().cpu().clone())

    handles = [layer.register_forward_hook(hook) for layer in model.layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token: ``||a - b|| / ||b||`` (0 where both are zero)."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def locate_parting(engine: list[torch.Tensor], learner: list[torch.Tensor]) -> Parting:
    """Compare two runs' :func:`layer_streams` (same tokens, same layers)."""
    if len(engine) != len(learner) or any(e.shape != lr.shape for e, lr in zip(engine, learner)):
        raise ValueError(f"the runs differ in shape: {[tuple(e.shape) for e in engine][:2]}... vs "
                         f"{[tuple(lr.shape) for lr in learner][:2]}...")
    first = part = None
    max_rel = 0.0
    for i, (e, lr) in enumerate(zip(engine, learner)):
        rel = _rel(e, lr)
        worst = int(rel.argmax()) if rel.numel() else 0
        top = float(rel[worst]) if rel.numel() else 0.0
        max_rel = max(max_rel, top)
        if first is None and not torch.equal(e, lr):
            first = (i, worst, top)
        if part is None and top >= PART_REL:
            part = (i, int((rel >= PART_REL).nonzero()[0]), top)
    f = first or (None, None, 0.0)
    p = part or (None, None, 0.0)
    return Parting(len(engine), f[0], f[1], f[2], p[0], p[1], p[2], max_rel)


def _token(decode: Callable[[list[int]], str] | None, ids: list[int], t: int) -> str:
    text = ""
    if decode is not None:
        try:
            text = decode([ids[t]])
        except Exception:  # noqa: BLE001 -- a name for the message only
            text = ""
    return f"token {t} of {len(ids)} (id {ids[t]}{', ' + repr(text) if text else ''})"


def explain_sync_failure(diff: float, ids: list[int], engine_model: nn.Module, run_engine: Callable[[], Any],
                         learner_model: nn.Module, run_learner: Callable[[], Any], scheme: str,
                         decode: Callable[[list[int]], str] | None = None) -> str:
    """One line: the check's gap, where the two sides' residual streams part (layer, token), and
    what to do. ``run_engine`` / ``run_learner`` run each side once over ``ids``."""
    head = f"engine and learner disagree after publishing (max |dlogp| = {diff:.3f})"
    try:
        p = locate_parting(layer_streams(engine_model, run_engine), layer_streams(learner_model, run_learner))
    except Exception as e:  # noqa: BLE001 -- the check's own verdict stands without the location
        return f"{head}; the layers could not be compared ({type(e).__name__}: {e}); report this line"
    report = f"report this line with the model and --quant.scheme={scheme}"
    if p.part_layer is None:
        return (f"{head}: all {p.layers} layers agree (largest difference {p.max_rel:.1e} of a token's norm), so the "
                f"final norm or the LM head differs: the engine holds a weight the learner did not publish; {report}")
    where = f"layers.{p.part_layer} (of {p.layers}), {_token(decode, ids, p.part_token)}"
    since = "" if p.first_layer is None or p.first_layer == p.part_layer else (
        f" (they first differ, by {p.first_rel:.1e}, at layers.{p.first_layer}, {_token(decode, ids, p.first_token)})")
    return (f"{head}: their hidden states part at {where}, by {p.part_rel:.1e} of its norm{since}: the engine's and "
            f"the learner's arithmetic differ there; {report}, and meanwhile train with --quant.mode=rollout (the "
            f"learner unquantized) or a weight-only scheme (--quant.scheme=w4a16)")
