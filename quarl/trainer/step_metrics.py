"""A step's logged row (docs/design.md names): rewards and response shapes, the update's
numbers, error tokens, throughput and timings, over the union of every rank's rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quarl.algos import error_metrics, repeat_fraction
from quarl.config.run import AlgoConfig
from quarl.distributed import Dist
from quarl.learner.batch import RolloutBatch
from quarl.runtime import process_totals
from quarl.trainer.error_tokens import FLAGGED_PER_STEP, error_rows, flagged_rows, flagged_sample, response_columns
from quarl.trainer.faults import budget_advice
from quarl.trainer.notices import Notices
from quarl.trainer.ranks import cat_of_all_ranks, rows_of_all_ranks
from quarl.trainer.stages import ErrorScan, Rollout, UpdateResult


@dataclass(frozen=True)
class LearnerWork:
    """What ``perf/learner_tflops`` and ``perf/learner_mfu`` count: the policy's matmul
    parameters, a LoRA learner's adapter parameters (its frozen base computes no weight
    gradient; None: a full fine-tune) and the GPU's matmul rate (None on CPU)."""

    matmul_params: int
    lora_params: int | None
    matmul_rate: float | None


def find_errors(batch: RolloutBatch, rollout: Rollout, union: Rollout, learner_logp: torch.Tensor,
                scan: ErrorScan | None, algo: AlgoConfig, overlong_filter: bool, flag_limit: int, dist: Dist,
                tokenizer) -> tuple[dict[str, float], list[dict]]:
    """The ``errors/*`` metrics (:func:`~quarl.algos.error_metrics`) of every rank's responses,
    from the learner's log-probs of the update (``old_logp``, else those of its own forward),
    reusing the update's ``scan`` where it covered the same rows; and up to ``flag_limit``
    flagged responses of ``union`` (every rank's ``rollout``, in row order) for ``samples.jsonl``."""
    mask = batch.response_mask
    if overlong_filter:  # its dropped responses count too (their loops: no log-probs)
        mask = response_columns(batch.attention_mask, [len(rollout.prompts[c.prompt_index])
                                                       for c in rollout.completions])
    if scan is not None and scan.mask is mask:  # the same rows the update's truncation scanned
        loops, garbled = scan.loops, scan.garbled
    else:
        loops, garbled = error_rows(batch.input_ids, learner_logp, batch.sampler_logp, mask, algo)
    (mask,) = rows_of_all_ranks(dist, mask)
    loops, garbled = cat_of_all_ranks(dist, loops), cat_of_all_ranks(dist, garbled)
    metrics = error_metrics(loops, garbled, mask)
    values = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))
    if flag_limit <= 0 or values["errors/response_frac"] == 0:
        return values, []
    first = (mask > 0).float().argmax(-1)  # (a response's columns are contiguous)
    end = first + (mask > 0).sum(-1)
    flagged = []
    for row, pos, kind in flagged_rows(loops.tolist(), garbled.tolist(), first.tolist(), end.tolist(), flag_limit):
        comp = union.completions[row]
        flagged.append(flagged_sample(
            tokenizer, union.prompts[comp.prompt_index], comp.token_ids,
            union.examples[comp.prompt_index].answer, float(union.rewards[row]), pos, kind))
    return values, flagged


def flag_limit(log_samples: int, logging: bool) -> int:
    """How many flagged responses a step keeps: none on a rank that does not log."""
    return min(FLAGGED_PER_STEP, log_samples) if logging else 0


def perf_metrics(update: UpdateResult, learner_s: float, work: LearnerWork, world: int,
                 totals_before: dict[str, float], packing: Any) -> dict[str, float]:
    """``perf/*``: the learner's tokens and FLOP rate per GPU (the ranks' tokens over their
    GPUs), the process's totals since ``totals_before``, and ``packing``'s (this rank's
    micro-batches; None: none)."""
    flops = update.model_flops(work.matmul_params, work.lora_params) / max(learner_s, 1e-9) / world
    perf = {"perf/learner_tokens": float(update.tokens), "perf/learner_tflops": flops / 1e12,
            **{k: v - totals_before[k] for k, v in process_totals().items()}}
    if work.matmul_rate:
        perf["perf/learner_mfu"] = flops / work.matmul_rate
    if packing is not None:
        perf.update(packing.metrics())
    return perf


def warn_about_step(notices: Notices, step: int, preempted: int, kv_tokens: int, larger_cache: str, packing: Any,
                    cuda: bool) -> None:
    """Once a run: a KV cache (``kv_tokens`` a rank) that made step ``step``'s rollouts preempt,
    and micro-batches that use the learner's token budget badly."""
    if preempted:
        notices.warn_once("preemption", (
            f"step {step}: the KV cache ({kv_tokens:,} tokens a rank) could not hold the step's rollouts at once: "
            f"{preempted} preemptions made sequences recompute their prefixes, which slows the rollout "
            "(rollout/preemptions). " + larger_cache))
    advice = budget_advice(packing, cuda) if packing is not None else None
    if advice:
        notices.warn_once("packing", f"step {step}: " + advice)


def step_metrics(rollout: Rollout, update: UpdateResult, errors: dict[str, float], quant_metrics: dict[str, float],
                 timing: dict[str, float], perf: dict[str, float], preempted: int, lr: float,
                 bad_steps: int) -> dict[str, float]:
    """The step's row: ``rollout`` is every rank's, ``errors`` :func:`find_errors`' metrics,
    ``preempted`` the engines' preemptions summed over the ranks."""
    m = update.metrics
    return {
        **perf,
        **rollout.reward_metrics,
        **rollout_metrics(rollout.completions, rollout.rewards),
        **update.mismatch,
        **errors,
        **m,
        **quant_metrics,
        **timing,
        "loss/policy": m.get("loss/policy", float("nan")),
        "tbpo/drop_frac_pos": m.get("tbpo/drop_frac_pos", 0.0),
        "tbpo/drop_frac_neg": m.get("tbpo/drop_frac_neg", 0.0),
        "train/lr": lr,
        "train/bad_steps": float(bad_steps),
        "rollout/tokens_per_s": rollout.generated_tokens / max(timing["time/rollout"], 1e-9),
        "rollout/preemptions": float(preempted),
    }


def rollout_metrics(completions, rewards: torch.Tensor) -> dict[str, float]:
    """Reward and response-shape metrics of one step's completions (docs/design.md names)."""
    lengths = [len(c.token_ids) for c in completions]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "acc/mean": float((rewards >= 1.0).float().mean()),
        "response/len_mean": sum(lengths) / len(lengths),
        "response/len_max": float(max(lengths)),
        "response/clip_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "response/repeat_frac": repeat_fraction([c.token_ids for c in completions]),
    }
