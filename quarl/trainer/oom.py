"""What to change when a step runs out of GPU memory.

torch's out-of-memory error says how much it tried to allocate; it cannot say which of the
run's settings decide the stage's memory. :func:`advice` names them for the stage that ran
out, with their current values and what to set instead, and only those that would help
(a setting already at its lean value is not offered).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from quarl.config import RunConfig


class OutOfGPUMemory(RuntimeError):
    """A step's stage ran out of GPU memory; the message names the settings to change."""


@dataclass(frozen=True)
class MemoryState:
    """What the run holds beside its config: whether the KV cache stays allocated through
    the learner phase, the number of ranks and whether the learner is sharded over them."""

    kv_kept: bool
    world: int
    sharded: bool


def _what_torch_said(error: BaseException) -> str:
    """The first sentences of torch's message (how much, how much was free), or ''."""
    found = re.search(r"Tried to allocate .*? is free", str(error))
    return found.group(0) if found else ""


def _learner(cfg: RunConfig, state: MemoryState, activations: bool = True) -> list[str]:
    """``activations``: the stage holds a micro-batch's activations (the update; the publish does not)."""
    t, out = cfg.trainer, []
    if activations and t.token_budget > 256:
        out.append(f"--trainer.token_budget={max(256, t.token_budget // 2)} (now {t.token_budget}: the tokens of "
                   "one micro-batch; the update's math is the same)")
    if activations and not t.activation_checkpointing:
        out.append("--trainer.activation_checkpointing=true (recompute each layer's activations in the backward)")
    if state.kv_kept:
        out.append("--rollout.kv_cache_in_update=release (free the engine's KV cache while the learner runs)")
    if cfg.optim.fp32_master:
        out.append("--optim.fp32_master=false --optim.state_dtype=bfloat16 (bf16 weights stepped with stochastic "
                   "rounding and bf16 Adam moments: 8 bytes a parameter instead of 16)")
    if state.world > 1 and not state.sharded:
        out.append("--trainer.shard_learner=true (each of the ranks holds 1/world of the weights and optimizer state)")
    elif state.sharded:
        out.append("more GPUs (a sharded learner's share of the state shrinks with each rank)")
    return out


def _engine(cfg: RunConfig, stage: str) -> list[str]:
    e = cfg.rollout.engine
    util = f"--rollout.engine.gpu_memory_utilization={max(0.05, round(e.gpu_memory_utilization - 0.1, 2))} (now " \
           f"{e.gpu_memory_utilization}: the engine's share of the GPU, its KV cache included)"
    if stage == "kv_cache":
        return [util]
    return [util, f"--rollout.engine.max_num_batched_tokens={max(1024, e.max_num_batched_tokens // 2)} (now "
                  f"{e.max_num_batched_tokens}: prompt tokens per prefill step)",
            f"--rollout.engine.max_num_seqs={max(16, e.max_num_seqs // 2)} (now {e.max_num_seqs}: sequences decoded "
            "together)"]


STAGES = {
    "rollout": "the rollout engine",
    "learner": "the learner's update",
    "publish": "publishing the new weights to the engine",
    "kv_cache": "re-creating the engine's KV cache after the update",
}


def advice(stage: str, step: int, error: BaseException, cfg: RunConfig, state: MemoryState) -> str:
    """The message of :class:`OutOfGPUMemory` for ``stage`` (a :class:`StageClock` stage name)
    of ``step``: what ran out, torch's numbers, and the settings that lower that stage's memory."""
    what = STAGES.get(stage, f"the step's {stage} stage")
    fixes = _learner(cfg, state, stage == "learner") if stage in ("learner", "publish") else _engine(cfg, stage)
    said = _what_torch_said(error)
    lines = [f"{what} ran out of GPU memory in step {step}" + (f" ({said})" if said else "") + "; any of these "
             "lowers it:"]
    lines += [f"  {fix}" for fix in fixes]
    return "\n".join(lines)


@contextlib.contextmanager
def naming_the_stage(clock: Any, step: int, cfg: RunConfig, state: MemoryState) -> Iterator[None]:
    """Around step ``step``: torch's out-of-memory error as :class:`OutOfGPUMemory`, which names
    the stage that ran out (``clock``: the step's :class:`~quarl.trainer.stages.StageClock`)
    and the settings that lower its memory."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise OutOfGPUMemory(advice(clock.out_of_memory or "step", step, e, cfg, state)) from e
