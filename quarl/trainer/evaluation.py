"""Greedy evaluation on the task's eval split, shared by the trainer's periodic evaluation and
``quarl eval``; and what ``quarl eval`` builds for it (:func:`build_for_evaluation`): the
engine with a checkpoint's policy, the data and the verifier, with no learner, optimizer or
reference model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from quarl.config import RunConfig
from quarl.config.run import RolloutConfig
from quarl.distributed import Dist, from_env
from quarl.learner.sharded import reshard
from quarl.model.lora import has_lora
from quarl.rollout import Engine
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.build import base_model, build_data, build_engine, seed_everything
from quarl.trainer.checkpointing import misfit, preflight
from quarl.trainer.collect import chat_prompt, sampling_params
from quarl.trainer.error_tokens import loop_fields
from quarl.trainer.notices import Notices
from quarl.trainer.setup import resolve_runtime
from quarl.trainer.warmstart import heldout_metrics


@dataclass
class Evaluation:
    """What a greedy evaluation of ``examples`` needs: the engine, the data, the verifier
    (``rewards``, a reward pool) and the ranks that share the decoding; ``solution_pairs``:
    worked solutions scored teacher-forced under the policy (rows of ``token_budget``)."""

    engine: Engine
    tokenizer: Any
    task: Any
    rewards: Any
    examples: list
    rollout: RolloutConfig
    max_prompt_len: int
    log_samples: int
    dist: Dist
    solution_pairs: list
    token_budget: int

    @torch.no_grad()
    def run(self, policy: nn.Module, stop: Callable[[], bool] | None = None,
            release: Callable[[], None] | None = None) -> tuple[dict[str, float], list[dict]]:
        """The task's metrics of the engine's greedy completions (``eval/*``), and the first
        ``log_samples`` of them as sample rows. ``policy``: the model whose own weights score
        the worked solutions (``eval/learner_exact``, ``eval/learner_nll``), after which
        ``release`` frees what its forward kept; ``stop``: whether to stop waiting for the verifier."""
        exs = self.examples
        if not exs:
            return {}, []
        prompts = [chat_prompt(self.tokenizer, self.task, e, self.max_prompt_len) for e in exs]
        params = sampling_params(self.rollout, self.tokenizer.eos_token_id, seed=0, temperature=0.0, n=1)
        k, r = self.dist.world, self.dist.rank  # each rank decodes a contiguous part, all see every text
        lo, hi = len(prompts) * r // k, len(prompts) * (r + 1) // k
        comps = self.engine.generate(prompts[lo:hi], params)
        texts = [t for part in self.dist.gather([self.tokenizer.decode(c.token_ids) for c in comps]) for t in part]
        # the user's verifier, through the timed pool as in training (a hang is cut off, an error scores 0)
        rewards, stats = self.rewards.score(texts, exs, stop=stop)
        metrics = {**self.task.evaluate(texts, exs, rewards),
                   "eval/reward_timeouts": stats["reward/timeouts"], "eval/reward_errors": stats["reward/errors"]}
        if self.solution_pairs:
            # the policy's own weights (in rollout mode the bf16 policy, where eval/acc is the engine's)
            longest = max(len(p) + len(r) for p, r in self.solution_pairs)  # rows of the learner's token budget
            scores = heldout_metrics(policy, self.solution_pairs,
                                     batch_size=max(1, min(64, self.token_budget // longest)))
            if release is not None:
                release()
            metrics["eval/learner_exact"], metrics["eval/learner_nll"] = scores["exact"], scores["loss"]
        loops = [f for part in self.dist.gather(loop_fields([c.token_ids for c in comps])) for f in part]
        samples = [
            {"prompt": self.tokenizer.decode(p), "completion": t, "answer": e.answer, "reward": r, **f}
            for p, t, e, r, f in list(zip(prompts, texts, exs, rewards, loops))[: self.log_samples]
        ]
        return metrics, samples


def evaluation_of(cfg: RunConfig, engine: Engine, data: Any, dist: Dist) -> Evaluation:
    """The run's :class:`Evaluation` of its eval split (``data``: its :class:`~quarl.trainer.build.RunData`)."""
    return Evaluation(engine, data.tokenizer, data.task, data.rewards, data.eval_examples, cfg.rollout,
                      cfg.data.max_prompt_len, cfg.trainer.log_samples, dist, data.solution_pairs,
                      cfg.trainer.token_budget)


def release_after_forward(learner: Any) -> Callable[[], None]:
    """What frees a learner's model after a forward outside its update: a sharded one's units
    back in shards, the dequantized weights its quantized linears kept."""
    def release() -> None:
        if learner.sharded:
            reshard(learner.model)
        learner.release_caches()

    return release


@dataclass
class EvalRun:
    """What ``quarl eval`` evaluates: the engine with the policy of checkpoint ``step`` (0: the
    model the config builds), that policy's own model, the data and the verifier."""

    cfg: RunConfig
    engine: Engine
    policy: nn.Module
    tokenizer: Any
    task: Any
    rewards: Any
    evaluation: Evaluation
    step: int


def build_for_evaluation(cfg: RunConfig, resume: bool) -> EvalRun:
    """The engine for ``cfg``'s scheme with the policy of the run's newest checkpoint that loads
    (``resume``; it must have one), else with the model the config builds (a model directory,
    warm-started where the config says so). The caller closes ``rewards``."""
    run_dir = Path(cfg.trainer.run_dir)
    dist = from_env(cfg.trainer.device)
    notices = Notices(None, dist.main)
    device, dtype = resolve_runtime(cfg)
    found = preflight(run_dir, cfg, resume, evaluation_only=True, allow_config_change=False, notices=notices)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.trainer.seed)
    data = build_data(cfg)
    base = base_model(cfg, data, device, dtype, run_dir, dist, notices, resuming=found is not None)
    engine, publisher = build_engine(cfg, base, dist, notices)
    step = 0
    if found is not None:
        try:
            step = load_policy(found, publisher.learner_model, run_dir)
        except ValueError:
            data.rewards.close()  # the worker processes must not outlive a failed start
            raise
    publisher.publish()  # the engine holds exactly the policy's weights
    return EvalRun(cfg, engine, publisher.learner_model, data.tokenizer, data.task, data.rewards,
                   evaluation_of(cfg, engine, data, dist), step)


def load_policy(found: tuple, model: nn.Module, run_dir: Path) -> int:
    """The policy's weights of the checkpoint :func:`~quarl.trainer.checkpointing.preflight`
    found loaded into ``model`` (a LoRA policy's: its adapters), as the learner loads them, and
    the random state restored; its step."""
    path, state, _ = found
    try:
        weights = ckpt.policy_weights(path, state)
        if has_lora(model):
            want = {n for n, p in model.named_parameters() if p.requires_grad}
            if set(weights) != want:
                missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
                raise KeyError(f"the checkpoint's adapters do not match this LoRA model (missing {missing[:3]}, "
                               f"unexpected {extra[:3]}): it was written with other model.lora_* settings")
            model.load_state_dict(weights, strict=False)
        else:
            model.load_state_dict(weights)
    except (RuntimeError, KeyError, ValueError) as e:
        raise misfit(path, run_dir, e) from e
    ckpt.set_rng_state(state["rng"])
    return state["step"]
