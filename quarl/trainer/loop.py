"""The QaRL training loop.

One step, top to bottom (docs/design.md, "Architecture"):

1. prompts      the next ``prompts_per_step`` examples of the task
2. rollout      the engine samples ``n`` completions per prompt (low-bit in
                ``rollout``/``aligned`` mode) and returns their log-probs
3. rewards      the task's verifier, in a process pool with a timeout
4. advantages   group-relative (GRPO, Dr.GRPO, RLOO) or GAE with a critic
5. old logp     the learner's log-probs of the sampled tokens before the update (in
                ``aligned`` mode through the same low-bit GEMM as the engine)
6. update       ``ppo_epochs`` x ``mini_batches`` steps of the configured loss
7. publish      the learner's weights (its packed low-bit tensors in ``aligned``
                mode, no re-quantization) are copied into the engine in place
8. log / eval / checkpoint

All randomness of a step is derived from ``(seed, step)``, so a resumed run repeats
the steps of an uninterrupted one exactly.

Under ``torchrun`` (:mod:`quarl.distributed`) every rank runs this loop on its share of each
step's prompts with its own engine: the samples of a prompt are seeded by the prompt's place in
the step, not by the rank, the learner sums its totals and gradients over the ranks, and each
step's metrics are computed over the union of the ranks' rollouts. Rank 0 alone logs, prints
and writes checkpoints (which hold no per-rank state, so a run resumes on any number of ranks).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from quarl.algos import (
    compute_advantages,
    compute_gae,
    drop_rows,
    before_error,
    error_metrics,
    garbled_starts,
    informative_groups,
    last_token_rewards,
    loop_starts,
    mismatch_metrics,
    repeat_fraction,
    whiten,
)
from quarl.algos.corrections import CorrectionSpec, mismatch_correction
from quarl.algos.losses import policy_loss_defaults, positive_advantage_mask
from quarl.config import RunConfig
from quarl.config.run import upgrade
from quarl.config.typed import dump_yaml, to_dict
from quarl.distributed import Dist, from_env
from quarl.learner.batch import RolloutBatch, build_batch
from quarl.learner.learner import Critic, Learner, UpdateSettings
from quarl.learner.sharded import reshard
from quarl.quant import QuantMode
from quarl.learner.memory import dense_bytes, frozen_bases, keep_frozen_bases_dense
from quarl.rollout import EngineConfig, SamplingParams
from quarl.tasks.tokenizer import load_tokenizer
from quarl.trainer import checkpoint as ckpt
from quarl.trainer import oom
from quarl.tasks.rewards import ScoringInterrupted
from quarl.trainer.error_tokens import FLAGGED_PER_STEP, flagged_rows, flagged_sample, loop_fields, response_columns
from quarl.trainer.faults import EvaluationFailed, budget_advice, rolled_back_on_verifier_failure
from quarl.trainer.interrupt import GracefulStop
from quarl.trainer.logger import MetricsLogger
from quarl.trainer.progress import StepProgress
from quarl.trainer.resume import apply_optimizer_settings, check_config_change, check_resumable, existing_run
from quarl.runtime import DTYPES, matmul_rate, process_totals
from quarl.trainer.setup import build_base_model, build_task_and_rewards, resolve_runtime, solution_pairs
from quarl.trainer.stages import Rollout, StageClock, UpdateResult
from quarl.trainer.warmstart import heldout_metrics
from quarl.trainer.weights import LoRASettings, build_engine_and_publisher


class TrainingAborted(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class Trainer:
    """One RL run in ``cfg.trainer.run_dir``.

    resume: continue from the newest checkpoint that loads (step 0 when the run has
        none); settings that changed since are checked by
        :func:`quarl.trainer.resume.check_config_change`, refused unless
        ``allow_config_change``. Nothing in the run directory is written before the
        checkpoint has loaded.
    evaluation_only: load the run's checkpoint to evaluate it; writes no run files (config, metrics).
    """

    # while run() trains in one process: whether a stop was asked for (the verifier's pool stops waiting)
    _stop_hook = None

    def __init__(self, cfg: RunConfig, resume: bool = False, console=None, evaluation_only: bool = False,
                 allow_config_change: bool = False) -> None:
        began = time.perf_counter()
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.run_dir)
        self.dist = from_env(cfg.trainer.device)
        self.dist.share(cfg.trainer.prompts_per_step)  # a step's prompts must split evenly over the ranks
        self.console = console if self.dist.main else None
        self.device, self.dtype = resolve_runtime(cfg)
        found = self._preflight(resume, evaluation_only, allow_config_change)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)

        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        self.task, self.rewards = build_task_and_rewards(cfg.data)
        self.train_examples = self.task.train_examples()
        self.eval_examples = self.task.eval_examples()
        # the eval split's worked solutions, scored teacher-forced under the learner at each evaluation
        self._solution_pairs = solution_pairs(self.task, self.tokenizer) if cfg.trainer.eval_teacher_forced else []
        # where the base is cached on disk (a warm-start, a packed low-bit base) rank 0 makes it
        # first and the others load it; otherwise every rank makes its own at once
        serial = cfg.trainer.sft_warmup_steps > 0 or cfg.model.packed_cache is not None
        if serial and not self.dist.main:
            self.dist.barrier()
        base = build_base_model(cfg, self.tokenizer, self.task, self.device, self.dtype, self.run_dir, self._say,
                                self.console, resuming=found is not None)
        if serial and self.dist.main:
            self.dist.barrier()

        m = cfg.model
        lora = LoRASettings(m.lora_rank, m.lora_scale_alpha, tuple(m.lora_targets)) if m.lora_rank else None
        if lora is not None and cfg.algo.kl_coef > 0:
            ref = None  # the reference of a LoRA policy is its base: the adapters switched off
        else:
            ref = copy.deepcopy(base).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        # a learner sharded over the ranks frees most of the base once sharded: the engine sizes its
        # KV cache after that, from the memory free then (before, a 14B base alone took 35% of an H100)
        sharded = cfg.trainer.shard_learner and self.dist.world > 1
        self.engine, self.publisher = build_engine_and_publisher(base, cfg.quant, self._engine_config(), lora,
                                                                 self.dist, kv_cache=not sharded)
        if self.engine.runner.dense_weight_bytes:
            self._say(f"engine keeps its {cfg.quant.scheme.name} weights dense too: "
                      f"{self.engine.runner.dense_weight_bytes / 2**30:.1f} GB (rollout.engine.dense_weights)")
        self._matmul_params = base.config.matmul_params
        self._lora_params = (sum(p.numel() for p in base.parameters() if p.requires_grad) if lora is not None
                             else None)  # the adapters (the base is frozen: perf/learner_mfu counts no weight grads)
        self._matmul_rate = matmul_rate(self.device)  # the denominator of perf/learner_mfu (None on CPU)
        # None: decided after the first learner phase (GPU, auto); on CPU the cache is host memory
        self._keep_kv = {"keep": True, "release": False}.get(
            cfg.rollout.kv_cache_in_update, True if self.device.type != "cuda" else None)
        # a LoRA learner's frozen low-bit base kept dequantized through each update: None =
        # decided after the first learner phase from its peak (GPU), False = never
        self._dense_base = None if (self.device.type == "cuda" and frozen_bases(self.publisher.learner_model)) \
            else False
        critic = Critic(base) if cfg.algo.advantage == "gae" else None
        self.learner = Learner(
            self.publisher.learner_model, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay,
            tuple(cfg.optim.betas), cfg.optim.muon_lr, cfg.optim.warmup_steps, ref, critic, cfg.optim.fp32_master,
            cfg.trainer.compile, state_dtype=DTYPES[cfg.optim.state_dtype],
            activation_checkpointing=cfg.trainer.activation_checkpointing, seed=cfg.trainer.seed, dist=self.dist,
            shard=cfg.trainer.shard_learner,
        )
        self.engine.reallocate_kv_cache()  # (a sharded run's engine sizes its cache now; else nothing to do)
        if self.learner.sharded:
            held, total = self.learner.held_parameters()
            self._say(f"learner sharded over {self.dist.world} ranks (FSDP2): each holds {held / 1e6:.3g}M of the "
                      f"model's {total / 1e6:.3g}M parameters")
        elif cfg.trainer.shard_learner:
            self._say("trainer.shard_learner: one process holds the whole learner (launch several ranks with "
                      "torchrun --nproc_per_node=N to shard it)")
        self.step = 0
        self.data_pos = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        self.bad_steps = 0
        self._preempted = 0  # this rank's engine preemptions in this step (a KV cache too small for its rollouts)
        self._warned_preemption = False
        self._warned_packing = False
        self._flagged_samples: list[dict] = []  # the last step's flagged responses, for samples.jsonl
        self._found_errors: tuple | None = None  # (mask, loops, garbled) the update's truncation found
        self.interrupted = False
        self._in_flight: int | None = None  # the step being computed, for the interrupt message
        self._saved_step: int | None = None
        start_step = self._restore(found, quarantine=not evaluation_only) if resume else None
        self.logger = None
        if not evaluation_only and self.dist.main:  # written only now: the checkpoint (if any) has loaded
            _write_atomic(self.run_dir / "config.yaml", dump_yaml(cfg))
            self.logger = MetricsLogger(self.run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project,
                                        to_dict(cfg), resume_step=start_step)
        self.publisher.publish()  # the engine starts from exactly the learner's weights
        self.sync_error = self._check_engine_sync()
        # building the run (data, base, engine, learner) in this process: the first row logged reports it
        self._setup_s: float | None = time.perf_counter() - began

    # ------------------------------------------------------------------ setup helpers
    def _say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg)

    def _warn(self, msg: str) -> None:
        """Printed even with --quiet: the user must know (a skipped checkpoint, a changed setting)."""
        if not self.dist.main:
            return
        if self.console is not None:
            self.console.print(f"[yellow]{msg}[/yellow]")
        else:
            print(msg, file=sys.stderr)

    def _larger_cache(self) -> str:
        """How to give the engine's KV cache more room."""
        e = self.cfg.rollout.engine
        if self.device.type != "cuda" or e.num_kv_blocks:
            return f"Raise rollout.engine.num_kv_blocks (now {self.engine.runner.num_blocks})"
        return f"Give the cache more memory: raise rollout.engine.gpu_memory_utilization (now {e.gpu_memory_utilization:g})"

    def _preflight(self, resume: bool, evaluation_only: bool, allow_config_change: bool):
        """Reads only. Refuses a new run into an existing one; loads and checks the checkpoint to resume."""
        existing = existing_run(self.run_dir)
        if not resume:
            if existing is not None and not evaluation_only:
                from_zero = " (from step 0: no checkpoint was written)" if "no checkpoint" in existing else ""
                raise ValueError(
                    f"{self.run_dir} already holds a run ({existing}): pass --resume to continue it{from_zero}, "
                    "or --trainer.run_dir=NEW_DIR to start another (or delete the directory)"
                )
            return None
        if not evaluation_only:
            check_resumable(self.run_dir)
        # to the CPU: the learner copies each tensor into its own (the whole state on the GPU next to the
        # model would double the learner's memory), and random generator states must stay CPU tensors
        found = ckpt.load_latest_intact(self.run_dir, map_location="cpu")
        if found is None:
            what = f"it holds {existing}" if existing else "it holds no run yet"
            if evaluation_only:  # an untrained model's score would pass for the run's
                raise ValueError(f"{self.run_dir} has no checkpoint to evaluate ({what}): train it first "
                                 f"(quarl train --resume --trainer.run_dir={self.run_dir}), or evaluate a model "
                                 "directory with quarl eval --model DIR")
            self._warn(f"--resume: no checkpoint in {self.run_dir} ({what}): starting from step 0")
            return None
        path, state, bad = found
        for bad_path, why in bad:
            self._warn(f"checkpoint {bad_path} cannot be loaded ({why}); using {path.name} (step {state['step']}) "
                       "instead")
        if not evaluation_only and isinstance(state.get("config"), dict):
            source = f"the config stored in {path}"
            for notice in check_config_change(upgrade(state["config"]), to_dict(self.cfg), source, allow_config_change,
                                              self.run_dir):
                self._warn(notice)
        return found

    def _engine_config(self) -> EngineConfig:
        r = self.cfg.rollout
        return dataclasses.replace(r.engine, max_model_len=self.cfg.data.max_prompt_len + r.max_new_tokens)

    def _check_engine_sync(self) -> float:
        """Engine vs learner log-probs of one fixed sequence right after publishing."""
        ex = self.eval_examples[0] if self.eval_examples else self.train_examples[0]
        ids = self.tokenizer.apply_chat_template(self.task.messages(ex))[-32:] + self.tokenizer.encode("12")
        batch = build_batch([ids[:1]], [ids[1:]], [[0.0] * (len(ids) - 1)], [0.0], torch.zeros(1)).to(self.device)
        ref = self.learner.logprobs(batch, 1 << 30)[0]
        self.learner.release_caches()
        diff = self.engine.check_logprobs(ids, ref.cpu())
        # A stale or mis-published weight shows as a gap of order 1; quantization noise is far smaller.
        # An fp8 KV cache the learner does not mirror (bf16 mode) is rollout-only rounding, like rollout mode.
        rollout_only = self.cfg.quant.mode is QuantMode.ROLLOUT or (
            self.cfg.rollout.engine.kv_cache_dtype == "fp8" and self.learner.model.kv_quant is None)
        if not rollout_only and diff > 0.5:  # (one line: where the two sides part, and what to do)
            from quarl.rollout.parity import EngineSyncError, explain_sync_failure

            raise EngineSyncError(explain_sync_failure(
                diff, ids, self.engine.runner.model, lambda: self.engine.check_logprobs(ids, ref.cpu()),
                self.learner.model, lambda: self.learner.logprobs(batch, 1 << 30), self.cfg.quant.scheme.name,
                self.tokenizer.decode))
        return diff

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, float]:
        """Train up to ``trainer.steps``; returns the last step's metrics.

        A first Ctrl-C/SIGTERM finishes the current step, saves and returns with
        ``self.interrupted`` set; a second raises KeyboardInterrupt at once, leaving the
        last complete checkpoint as it was (see :mod:`quarl.trainer.interrupt`).
        """
        t = self.cfg.trainer
        last: dict[str, float] = {}
        try:
            with GracefulStop(lambda: self._in_flight, lambda: self._saved_step) as stop, \
                    StepProgress(t.steps, self.step, self.console) as progress:
                # ranks must agree on when they stop: on several, a step is always finished
                self._stop_hook = (lambda: stop.requested) if self.dist.world == 1 else None
                if t.eval_before_train and self.step == 0 and self.eval_examples:
                    start = self._timed_evaluation()
                    if start:
                        self._log(0, start)
                while self.step < t.steps and not self._stop_requested(stop):
                    self._in_flight = self.step + 1
                    try:
                        with rolled_back_on_verifier_failure(self):
                            last = self._step_and_log()
                    except ScoringInterrupted:
                        self._warn(f"step {self._in_flight} abandoned: its verifier was still busy; a resume "
                                   "repeats it")
                        break
                    self._in_flight = None
                    progress.update(self.step, last)
                    if t.save_every > 0 and self.step % t.save_every == 0 and self._saved_step != self.step:
                        self.save()
                self.interrupted = self._stop_requested(stop)
                if self._saved_step != self.step and (self.step > 0 or not self.interrupted):
                    self.save()  # (stopped before step 1 finished: nothing to keep)
        finally:
            self._stop_hook = None
            if self.logger is not None:
                self.logger.close()
            self.rewards.close()
        return last

    def _stop_requested(self, stop: GracefulStop) -> bool:
        """Whether any rank was asked to stop: the ranks stop after the same step."""
        return bool(self.dist.max(int(stop.requested)))

    def _step_and_log(self) -> dict[str, float]:
        t = self.cfg.trainer
        metrics = self.train_step()
        self.step += 1
        if self.logger is not None and self._flagged_samples:
            self.logger.log_samples(self.step, self._flagged_samples, tag="flagged")
        if t.eval_every > 0 and (self.step % t.eval_every == 0 or self.step == t.steps):
            if self.step == t.steps and self._saved_step != self.step:
                self.save()  # the run's last checkpoint, written before its evaluation can fail
            try:
                metrics.update(self._timed_evaluation(engine_check=True))
            except Exception as e:  # noqa: BLE001 -- whatever failed, the trained step is kept
                self._log(self.step, metrics)
                if self._saved_step != self.step:
                    self.save()
                raise EvaluationFailed(self.step, e) from e
        self._log(self.step, metrics)
        return metrics

    def _timed_evaluation(self, engine_check: bool = False) -> dict[str, float]:
        """:meth:`evaluate` with ``perf/eval_s`` (outside the step: not a ``time/`` part) and, after a
        step, the engine check; nothing when a stop cut its verifier short."""
        start = time.perf_counter()
        try:
            metrics = self.evaluate()
        except ScoringInterrupted:
            self._warn(f"evaluation of step {self.step} skipped: its verifier was still busy when asked to stop")
            return {}
        if engine_check:
            metrics["mismatch/engine_check"] = self._check_engine_sync()
        metrics["perf/eval_s"] = time.perf_counter() - start
        return metrics

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self._setup_s is not None:
            metrics["perf/setup_s"], self._setup_s = self._setup_s, None
        if self.logger is not None:
            self.logger.log(step, metrics)

    def train_step(self) -> dict[str, float]:
        """One step: rollout -> advantages -> update -> publish; returns its metrics."""
        clock = StageClock(self.device)
        self._preempted = 0
        self._totals_before = process_totals()
        with self._naming_out_of_memory(clock), clock.stage("step"):
            rollout = self.collect_rollout(clock)                                          # 1-3
            # every rank's preemptions: the sum is where a rank waits for the slowest rank's
            # rollout (timed on its own; else it falls into the learner's first collective)
            with clock.stage("rank_wait") if self.dist.world > 1 else contextlib.nullcontext():
                (preempted,) = self.dist.sum([self._preempted])
            batch = self.score(rollout).to(self.device)                                    # 4
            release = not self._keep_kv
            with clock.stage("kv_cache"):
                if release:
                    self.engine.release_kv_cache()
            with clock.stage("learner", memory=True):
                update = self.update_policy(batch)                                         # 5-6
            with clock.stage("publish"):  # (before the KV cache returns: a sharded publish gathers whole tensors)
                quant_metrics = self.publisher.publish()                                   # 7
            with clock.stage("kv_cache"):
                if release:
                    self.engine.reallocate_kv_cache()
        if self._keep_kv is None:
            self._keep_kv = self._kv_cache_fits(clock.peak_gb["learner"])
        if self._dense_base is None:
            self._dense_base = self._dense_base_fits(clock.peak_gb["learner"], kv_counted=not release)
        self._check_finite(update)
        union = self._union(rollout)
        errors = self.find_errors(batch, rollout, union)
        return self._step_metrics(union, update, errors, quant_metrics, clock, int(preempted))

    @contextlib.contextmanager
    def _naming_out_of_memory(self, clock: StageClock):
        """torch's out-of-memory error as :class:`~quarl.trainer.oom.OutOfGPUMemory`, which names
        the stage that ran out and the settings that lower its memory."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            state = oom.MemoryState(kv_kept=self._keep_kv is True, world=self.dist.world, sharded=self.learner.sharded)
            raise oom.OutOfGPUMemory(oom.advice(clock.out_of_memory or "step", self.step + 1, e, self.cfg, state)) from e

    def _union(self, rollout: Rollout) -> Rollout:
        """Every rank's groups of ``rollout`` in rank order (the step's prompt order), the
        verifier's counts and the generated tokens summed over the ranks (DAPO's counts were
        taken over every rank already)."""
        if self.dist.world == 1:
            return rollout
        parts = self.dist.gather(rollout)
        union = parts[0]
        for part in parts[1:]:
            union = union.extend(part)
        counts = {k: sum(p.reward_metrics.get(k, 0.0) for p in parts) if k.startswith("reward/") else v
                  for k, v in parts[0].reward_metrics.items()}
        return dataclasses.replace(union, reward_metrics=counts,
                                   generated_tokens=sum(p.generated_tokens for p in parts))

    def _kv_cache_fits(self, learner_peak_gb: float) -> bool:
        """Whether the KV cache can stay through the learner phase (``kv_cache_in_update=auto``)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        kv = self.engine.kv_cache_bytes
        fits = learner_peak_gb * 2**30 + kv <= 0.9 * total
        self._say(f"KV cache ({kv / 2**30:.1f} GB) {'kept' if fits else 'released'} during the learner phase: "
                  f"learner peak {learner_peak_gb:.1f} GB, GPU {total / 2**30:.0f} GB")
        return fits

    def _dense_base_fits(self, learner_peak_gb: float, kv_counted: bool) -> bool:
        """Whether a LoRA learner can keep its frozen base dequantized through each update
        (:func:`~quarl.quant.linear.keep_frozen_bases_dense`): its bf16 size on top of the
        first update's peak (plus the KV cache when it stays and was not in that peak) within
        90% of the GPU; the KV cache's decision comes first."""
        model = self.learner.model
        dense = dense_bytes(frozen_bases(model), model.embed_tokens.weight.dtype)
        total = torch.cuda.get_device_properties(self.device).total_memory
        kv = self.engine.kv_cache_bytes if self._keep_kv and not kv_counted else 0
        fits = learner_peak_gb * 2**30 + kv + dense <= 0.9 * total
        keep_frozen_bases_dense(model, fits)
        self._say(f"LoRA base ({dense / 2**30:.1f} GB in bf16) {'kept dense' if fits else 'dequantized per GEMM'} "
                  f"during the learner phase: learner peak {learner_peak_gb:.1f} GB, GPU {total / 2**30:.0f} GB")
        return fits

    # ------------------------------------------------------------------ stages
    def collect_rollout(self, clock: StageClock) -> Rollout:
        """Stages 1-3: the next prompts, ``n`` completions each, their rewards (DAPO refills)."""
        prompts, examples = self._next_prompts(self.cfg.trainer.prompts_per_step)
        mine = self.dist.share(len(prompts))  # every rank draws the step's prompts, then takes its share
        prompts, examples = prompts[mine.start : mine.stop], examples[mine.start : mine.stop]
        with clock.stage("rollout", memory=True):
            completions = self._rollout(prompts, seed_offset=0, first=mine.start)
        rewards, reward_metrics = self._score(completions, examples)
        rollout = Rollout(prompts, examples, completions, rewards, reward_metrics,
                          sum(len(c.token_ids) for c in completions))
        if self.cfg.trainer.dynamic_sampling:
            rollout = self._dynamic_sampling(rollout)
        return rollout

    def score(self, rollout: Rollout) -> RolloutBatch:
        """Stage 4: the learner's batch with group-relative advantages (GAE fills them in the update)."""
        a, n = self.cfg.algo, self.cfg.rollout.n
        adv = torch.zeros_like(rollout.rewards) if a.advantage == "gae" else \
            compute_advantages(a.advantage, rollout.rewards, n)
        comps = rollout.completions
        batch = build_batch([rollout.prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps],
                            [c.logprobs for c in comps], rollout.rewards.tolist(), adv)
        if self.cfg.trainer.overlong_filter:
            truncated = torch.tensor([c.finish_reason == "length" for c in comps])
            batch.response_mask = drop_rows(batch.response_mask, truncated)
        return batch

    def update_policy(self, batch: RolloutBatch) -> UpdateResult:
        """Stages 5-6: old / reference log-probs when the update needs them, then the update."""
        cfg = self.cfg
        settings = self._update_settings()
        budget, temp = cfg.trainer.token_budget, cfg.rollout.temperature
        spec = cfg.algo.correction_spec()
        removes = spec.rejects or cfg.algo.truncate_at_error
        # else the update's own forward gives old_logp; what the update removes is known before
        # it (from old_logp), so that every micro-batch's share of the loss counts kept tokens
        if (settings.ppo_epochs, settings.mini_batches) != (1, 1) or removes:
            batch.old_logp = self.learner.logprobs(batch, budget, temp)
        if cfg.algo.kl_coef > 0:
            batch.ref_logp = self.learner.logprobs(batch, budget, temp, ref=True)
        returns = self._gae(batch) if cfg.algo.advantage == "gae" else None
        extra = (batch.old_logp is not None) + (batch.ref_logp is not None) + (returns is not None)
        full_mask = batch.response_mask
        removed: dict[str, float] = {}
        if removes:
            batch.response_mask, removed = self._removals(batch, spec)
        if cfg.algo.loss == "positive_only" and returns is None:
            # its A < 0 responses leave the mask up front too, so that the micro-batches' shares of the
            # loss count the responses it trains on (with GAE the critic needs every token: the loss drops them)
            kept = positive_advantage_mask(batch.advantages, batch.response_mask)
            tokens, n_kept = self.dist.sum([float(batch.response_mask.sum()), float(kept.sum())])
            batch.response_mask = kept
            removed["positive_only/drop_frac"] = 1.0 - n_kept / max(tokens, 1.0)
        metrics = self.learner.update(batch, settings, returns)
        batch.response_mask = full_mask
        metrics.update(removed)
        old_logp = batch.old_logp if batch.old_logp is not None else self.learner.last_logp
        rows = _rows_of_all_ranks(self.dist, old_logp, batch.sampler_logp, batch.response_mask)
        (tokens,) = self.dist.sum([int(batch.attention_mask.sum())])
        return UpdateResult(metrics, mismatch_metrics(*rows), tokens=int(tokens), extra_forwards=int(extra))

    def _removals(self, batch: RolloutBatch, spec: CorrectionSpec) -> tuple[torch.Tensor, dict[str, float]]:
        """The response mask less the tokens the correction's rejection and veto remove and,
        with ``algo.truncate_at_error``, less every token from a response's first error token
        on; with the shares removed over every rank (``correction/drop_frac``: tokens the
        correction removed, ``correction/row_drop_frac``: responses it emptied,
        ``errors/truncated_frac``: tokens the truncation removed besides)."""
        a, mask = self.cfg.algo, batch.response_mask
        kept = mismatch_correction(spec, batch.old_logp, batch.sampler_logp, mask).keep.to(mask.dtype)
        truncated = kept
        if a.truncate_at_error:
            loops, garbled = self._error_rows(batch, batch.old_logp, mask)
            self._found_errors = (mask, loops, garbled)  # find_errors reads them again after the update
            truncated = before_error(kept, torch.minimum(loops, garbled))
        rows = mask.sum(-1) > 0
        counts = torch.stack([mask.sum(), kept.sum(), truncated.sum(), rows.sum(), (rows & (kept.sum(-1) > 0)).sum()])
        tokens, n_kept, n_truncated, n_rows, n_kept_rows = self.dist.sum(counts.double().tolist())
        return truncated, {
            "correction/drop_frac": 1.0 - n_kept / max(tokens, 1.0),
            "correction/row_drop_frac": 1.0 - n_kept_rows / max(n_rows, 1.0),
            "errors/truncated_frac": (n_kept - n_truncated) / max(tokens, 1.0),
        }

    def _step_metrics(self, rollout: Rollout, update: UpdateResult, errors: dict[str, float],
                      quant_metrics: dict[str, float], clock: StageClock, preempted: int) -> dict[str, float]:
        """``errors``: :meth:`find_errors`' metrics; ``preempted``: the engines' preemptions of
        this step, summed over the ranks."""
        m = update.metrics
        timing = clock.metrics()
        # per GPU: the ranks' tokens over their GPUs
        flops = update.model_flops(self._matmul_params, self._lora_params) / max(timing["time/learner"], 1e-9) \
            / self.dist.world
        perf = {"perf/learner_tokens": float(update.tokens), "perf/learner_tflops": flops / 1e12,
                **{k: v - self._totals_before[k] for k, v in process_totals().items()}}
        if self._matmul_rate:
            perf["perf/learner_mfu"] = flops / self._matmul_rate
        if preempted and not self._warned_preemption:
            self._warned_preemption = True
            runner = self.engine.runner
            self._warn(f"step {self.step + 1}: the KV cache ({runner.num_blocks * runner.block_size:,} tokens a rank) "
                       f"could not hold the step's rollouts at once: {preempted} preemptions made sequences "
                       "recompute their prefixes, which slows the rollout (rollout/preemptions). " + self._larger_cache())
        packing = self.learner.last_packing  # (this rank's rows)
        if packing is not None:
            perf.update(packing.metrics())
            advice = budget_advice(packing, self.device.type == "cuda")
            if advice and not self._warned_packing:
                self._warned_packing = True
                self._warn(f"step {self.step + 1}: " + advice)
        return {
            **perf,
            **rollout.reward_metrics,
            **_rollout_metrics(rollout.completions, rollout.rewards),
            **update.mismatch,
            **errors,
            **m,
            **quant_metrics,
            **timing,
            "loss/policy": m.get("loss/policy", float("nan")),
            "tbpo/drop_frac_pos": m.get("tbpo/drop_frac_pos", 0.0),
            "tbpo/drop_frac_neg": m.get("tbpo/drop_frac_neg", 0.0),
            "train/lr": self.learner.scheduler.get_last_lr()[0],
            "train/bad_steps": float(self.bad_steps),
            "rollout/tokens_per_s": rollout.generated_tokens / max(timing["time/rollout"], 1e-9),
            "rollout/preemptions": float(preempted),
        }

    def find_errors(self, batch: RolloutBatch, rollout: Rollout, union: Rollout) -> dict[str, float]:
        """The ``errors/*`` metrics (:func:`~quarl.algos.error_metrics`) of every rank's responses,
        from the learner's log-probs of the update (``old_logp``, else those of its own forward);
        on the logging rank also keeps up to :data:`FLAGGED_PER_STEP` flagged responses of
        ``union`` (every rank's ``rollout``, in row order) for ``samples.jsonl``."""
        a = self.cfg.algo
        learner_logp = batch.old_logp if batch.old_logp is not None else self.learner.last_logp
        mask = batch.response_mask
        if self.cfg.trainer.overlong_filter:  # its dropped responses count too (their loops: no log-probs)
            mask = response_columns(batch.attention_mask, [len(rollout.prompts[c.prompt_index])
                                                           for c in rollout.completions])
        found, self._found_errors = self._found_errors, None
        if found is not None and found[0] is mask:  # the same rows the update's truncation scanned
            _, loops, garbled = found
        else:
            loops, garbled = self._error_rows(batch, learner_logp, mask)
        (mask,) = _rows_of_all_ranks(self.dist, mask)
        loops, garbled = _cat_of_all_ranks(self.dist, loops), _cat_of_all_ranks(self.dist, garbled)
        metrics = error_metrics(loops, garbled, mask)
        values = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))
        self._flagged_samples = []
        limit = min(FLAGGED_PER_STEP, self.cfg.trainer.log_samples)
        if self.logger is None or limit <= 0 or values["errors/response_frac"] == 0:
            return values
        first = (mask > 0).float().argmax(-1)  # (a response's columns are contiguous)
        end = first + (mask > 0).sum(-1)
        for row, pos, kind in flagged_rows(loops.tolist(), garbled.tolist(), first.tolist(), end.tolist(), limit):
            comp = union.completions[row]
            self._flagged_samples.append(flagged_sample(
                self.tokenizer, union.prompts[comp.prompt_index], comp.token_ids,
                union.examples[comp.prompt_index].answer, float(union.rewards[row]), pos, kind))
        return values

    def _error_rows(self, batch: RolloutBatch, learner_logp: torch.Tensor, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each response's first loop token and first garbled token (``[B]``, ``T`` where none)."""
        a = self.cfg.algo
        loops = loop_starts(batch.input_ids[:, 1:], mask)  # (token t + 1 beside the log-probs of column t)
        garbled = garbled_starts(learner_logp, batch.sampler_logp, mask, surprise=a.error_surprise,
                                 gap=a.error_gap, window=a.error_window, min_bad=a.error_min_bad)
        return loops, garbled

    def _next_prompts(self, count: int):
        """The next ``count`` examples of a seeded, per-epoch shuffle (resumable by position)."""
        n = len(self.train_examples)
        out_prompts, out_examples = [], []
        for _ in range(count):
            epoch, idx = divmod(self.data_pos, n)
            if self._epoch_order[0] != epoch:
                order = list(range(n))
                random.Random(self.cfg.data.seed * 1_000_003 + epoch).shuffle(order)
                self._epoch_order = (epoch, order)
            ex = self.train_examples[self._epoch_order[1][idx]]
            self.data_pos += 1
            ids = self.tokenizer.apply_chat_template(self.task.messages(ex))
            out_prompts.append(ids[-self.cfg.data.max_prompt_len :])
            out_examples.append(ex)
        return out_prompts, out_examples

    def _sampling_params(self, seed: int, temperature: float | None = None, n: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n if n is None else n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
            stop_token_ids=(self.tokenizer.eos_token_id,), seed=seed,
        )

    def _rollout(self, prompts: list[list[int]], seed_offset: int, first: int = 0):
        """``first``: the step's index of ``prompts[0]`` (a rank's share starts there)."""
        base = (self.cfg.trainer.seed * 1_000_003 + self.step) * 1009 + seed_offset
        params = [self._sampling_params(base * 4099 + first + i) for i in range(len(prompts))]
        completions = self.engine.generate(prompts, params)
        self._preempted += self.engine.stats.preemptions
        return completions

    def _score(self, completions, examples) -> tuple[torch.Tensor, dict[str, float]]:
        n = self.cfg.rollout.n
        texts = [self.tokenizer.decode(c.token_ids) for c in completions]
        exs = [examples[c.prompt_index] for c in completions]
        scores, stats = self.rewards.score(texts, exs, stop=self._stop_hook)
        assert len(scores) == len(completions) == len(examples) * n
        return torch.tensor(scores, dtype=torch.float32), stats

    def _dynamic_sampling(self, first: Rollout) -> Rollout:
        """DAPO: keep the groups whose rewards differ, refill from fresh prompts (3 rounds at most).
        On several ranks the choice is made over every rank's groups (each rank samples its
        share of a refill too), and the kept groups are then shared out again."""
        n, want = self.cfg.rollout.n, self.cfg.trainer.prompts_per_step
        kept, current, dropped, rounds = None, self._union(first), 0, 0
        while True:
            take = []
            for g, informative in enumerate(informative_groups(current.rewards, n).tolist()):
                if len(take) + (len(kept.prompts) if kept else 0) == want:
                    break
                if informative:
                    take.append(g)
                else:
                    dropped += 1
            part = current.select(take, n)
            kept = part if kept is None else kept.extend(part)
            if len(kept.prompts) == want or rounds >= 3:
                break
            rounds += 1
            prompts, examples = self._next_prompts(want)
            mine = self.dist.share(want)
            prompts, examples = prompts[mine.start : mine.stop], examples[mine.start : mine.stop]
            completions = self._rollout(prompts, seed_offset=rounds, first=mine.start)
            rewards, _ = self._score(completions, examples)
            current = self._union(Rollout(prompts, examples, completions, rewards, {}, 0))
        # every group was uniform: train on the last batch as is (zero advantages); so too when
        # fewer groups than ranks are left (a rank cannot train on none)
        if len(kept.prompts) < self.dist.world:
            kept = current
        k, r = self.dist.world, self.dist.rank
        count = len(kept.prompts)
        kept = kept.select(list(range(count * r // k, count * (r + 1) // k)), n)
        extra = {"dapo/dropped_groups": float(dropped), "dapo/refill_rounds": float(rounds)}
        return dataclasses.replace(kept, reward_metrics={**first.reward_metrics, **extra},
                                   generated_tokens=first.generated_tokens)

    def _gae(self, batch: RolloutBatch) -> torch.Tensor:
        """Token-level advantages from the critic, whitened over the batch's response tokens."""
        mask = batch.response_mask
        values = self.learner.values(batch, self.cfg.trainer.token_budget)
        adv, returns = compute_gae(last_token_rewards(batch.rewards, mask), values, mask,
                                   self.cfg.algo.gamma, self.cfg.algo.lam)
        batch.advantages = whiten(adv, mask) if self.dist.world == 1 else _whiten_over_ranks(self.dist, adv, mask)
        return returns

    def _update_settings(self) -> UpdateSettings:
        a, t = self.cfg.algo, self.cfg.trainer
        valid = policy_loss_defaults(a.loss)
        wanted = {
            "eps_low": a.eps_low, "eps_high": a.eps_high, "delta_low": a.delta_low, "delta_high": a.delta_high,
            "dual_clip_c": a.dual_clip_c, "cap": a.cap, "tau_pos": a.tau_pos, "tau_neg": a.tau_neg,
            # what the correction removes leaves the batch's mask before the update (update_policy)
            "agg": a.agg, "correction": a.correction_spec().without_rejection(),
        }
        hp = {k: v for k, v in wanted.items() if v is not None and k in valid}
        ppo_epochs, mini_batches = (1, 1) if t.on_policy else (t.ppo_epochs, t.mini_batches)
        return UpdateSettings(
            loss_type=a.loss, loss_hparams=hp, ppo_epochs=ppo_epochs, mini_batches=mini_batches,
            token_budget=t.token_budget, temperature=self.cfg.rollout.temperature,
            grad_clip=self.cfg.optim.grad_clip, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
            value_coef=a.value_coef,
        )

    def _check_finite(self, update: UpdateResult) -> None:
        if update.metrics.get("train/skipped_updates", 0) > 0:
            self.bad_steps += 1
            bad = self.learner.last_nonfinite + sorted(k for k, v in update.mismatch.items() if not math.isfinite(v))
            self._say(f"[yellow]step {self.step + 1}: non-finite loss or gradient ({', '.join(bad) or 'grad_norm'}), "
                      f"update skipped ({self.bad_steps} in a row)[/yellow]")
            if self.bad_steps >= self.cfg.trainer.max_bad_steps:
                raise TrainingAborted(
                    f"{self.bad_steps} consecutive steps had a non-finite loss or gradient "
                    f"(last: {', '.join(bad) or 'grad_norm'}); lower optim.lr "
                    "or check the data (the last good checkpoint is intact)"
                )
        else:
            self.bad_steps = 0

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self, log: bool = True) -> dict[str, float]:
        exs = self.eval_examples
        if not exs:
            return {}
        prompts = [self.tokenizer.apply_chat_template(self.task.messages(e))[-self.cfg.data.max_prompt_len :]
                   for e in exs]
        params = self._sampling_params(seed=0, temperature=0.0, n=1)
        k, r = self.dist.world, self.dist.rank  # each rank decodes a contiguous part, all see every text
        lo, hi = len(prompts) * r // k, len(prompts) * (r + 1) // k
        comps = self.engine.generate(prompts[lo:hi], params)
        texts = [t for part in self.dist.gather([self.tokenizer.decode(c.token_ids) for c in comps]) for t in part]
        # the user's verifier, through the timed pool as in training (a hang is cut off, an error scores 0)
        rewards, stats = self.rewards.score(texts, exs, stop=self._stop_hook)
        metrics = {**self.task.evaluate(texts, exs, rewards),
                   "eval/reward_timeouts": stats["reward/timeouts"], "eval/reward_errors": stats["reward/errors"]}
        if self._solution_pairs:
            # the learner's own weights (in rollout mode the bf16 policy, where eval/acc is the engine's)
            longest = max(len(p) + len(r) for p, r in self._solution_pairs)  # rows of the learner's token budget
            scores = heldout_metrics(self.learner.model, self._solution_pairs,
                                     batch_size=max(1, min(64, self.cfg.trainer.token_budget // longest)))
            if self.learner.sharded:
                reshard(self.learner.model)
            self.learner.release_caches()
            metrics["eval/learner_exact"], metrics["eval/learner_nll"] = scores["exact"], scores["loss"]
        k = self.cfg.trainer.log_samples
        loops = [f for part in self.dist.gather(loop_fields([c.token_ids for c in comps])) for f in part]
        samples = [
            {"prompt": self.tokenizer.decode(p), "completion": t, "answer": e.answer, "reward": r, **f}
            for p, t, e, r, f in list(zip(prompts, texts, exs, rewards, loops))[:k]
        ]
        if log and self.logger is not None:
            self.logger.log_samples(self.step, samples)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Write this step's checkpoint atomically (:class:`ckpt.CheckpointWriteError` if it cannot be).
        On several ranks rank 0 writes it (every rank holds the same weights and optimizer
        state) while the others wait; a sharded learner's ranks each write their shards
        (:meth:`_save_sharded`)."""
        if self.learner.sharded:
            return self._save_sharded()
        if not self.dist.main:
            self.dist.barrier()
            self._saved_step = self.step
            return self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        state = self._state(self.learner.state_dict())
        try:
            path = ckpt.save_checkpoint(self.run_dir, self.step, state, self.cfg.trainer.keep_last)
        finally:
            self.dist.barrier()
        self._saved_step = self.step
        return path

    def _state(self, learner: dict) -> dict:
        """A checkpoint's contents besides the learner's tensors."""
        return {"step": self.step, "data_pos": self.data_pos, "bad_steps": self.bad_steps, "learner": learner,
                "rng": ckpt.rng_state(), "config": to_dict(self.cfg)}

    def _save_sharded(self) -> Path:
        """A sharded learner's checkpoint: every rank writes its shards of the learner's tensors
        with ``torch.distributed.checkpoint`` into ``learner/`` of rank 0's temporary directory,
        then rank 0 adds the rest and renames it into place. A rank whose write fails fails
        the checkpoint on every rank (:class:`ckpt.CheckpointWriteError`); the previous one
        stays intact."""
        import torch.distributed.checkpoint as dcp

        tensors, rest = self.learner.sharded_state()
        pid = self.dist.gather(os.getpid())[0]  # rank 0's temporary directory
        tmp = ckpt.temporary_dir(self.run_dir, self.step, pid)
        error: BaseException | None = None
        if self.dist.main:
            try:
                ckpt.start_checkpoint(self.run_dir, self.step, pid)
            except ckpt.CheckpointWriteError as e:
                error = e
        # the ranks agree after each part (the same collectives on every rank, whichever failed)
        failed = self.dist.max(int(error is not None))
        if not failed:
            try:
                dcp.save(tensors, checkpoint_id=str(tmp / "learner"))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # a full disk on any rank fails the collective save on all (CheckpointException)
                error = _first_failure(e)
            failed = self.dist.max(int(error is not None))
            if not failed:
                if self.dist.main:
                    try:  # (removes the temporary directory itself if it fails)
                        ckpt.save_checkpoint(self.run_dir, self.step, self._state(rest), self.cfg.trainer.keep_last,
                                             tmp=tmp)
                    except ckpt.CheckpointWriteError as e:
                        error = e
                failed = self.dist.max(int(error is not None))  # (the others wait for rank 0's rename)
        if failed:
            if not self.dist.main:  # rank 0 reports the cause
                raise ckpt.CheckpointWriteError(getattr(error, "errno", None),
                                                f"the checkpoint of step {self.step} could not be written")
            if isinstance(error, ckpt.CheckpointWriteError):
                raise error
            raise ckpt.discard_checkpoint(tmp, self.run_dir, self.step,
                                          error or RuntimeError("another rank could not write its part"))
        self._saved_step = self.step
        return self.run_dir / "checkpoints" / f"step_{self.step:06d}"

    def _restore(self, found, quarantine: bool) -> int:
        """Load what :meth:`_preflight` found; the step resumed from (0 without a checkpoint)."""
        if found is None:
            return 0
        path, state, bad = found
        try:
            if state["learner"].get("format") == ckpt.SHARDED_FORMAT:  # a sharded learner's
                self.learner.load_sharded_state(path / "learner", state["learner"])
            else:
                self.learner.load_state_dict(state["learner"])
        except (RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.rewards.close()  # the worker processes must not outlive a failed start
            raise ValueError(
                f"checkpoint {path} does not fit the model built from this config ({first}): it was written "
                "with other model, quant or optim settings. Resume with the run's own settings "
                f"('quarl train --resume --trainer.run_dir={self.run_dir}' uses its config.yaml)"
            ) from e
        apply_optimizer_settings(self.learner, self.cfg.optim)  # the config's, not those stored with the state
        self.step, self.data_pos, self.bad_steps = state["step"], state["data_pos"], state["bad_steps"]
        self._saved_step = self.step
        ckpt.set_rng_state(state["rng"])
        for bad_path, _ in bad if quarantine else []:
            # out of the way, not deleted: the run must not pick it up again, and nothing is lost
            aside = bad_path.with_name(f"{bad_path.name}.corrupt-{os.getpid()}")
            bad_path.rename(aside)
            self._warn(f"moved the unreadable checkpoint aside to {aside}")
        self._say(f"resumed from {path} (step {self.step})")
        return self.step


def _first_failure(e: BaseException) -> BaseException:
    """The error behind a failed ``torch.distributed.checkpoint`` call (its CheckpointException
    carries each failed rank's), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _trace) = min(failures.items(), key=lambda kv: kv[0])
        return type(exc)(*exc.args) if isinstance(exc, OSError) else RuntimeError(f"rank {rank}: {exc}")
    return e


def _whiten_over_ranks(dist: Dist, values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """:func:`~quarl.algos.whiten` over the response tokens of every rank: the mean and the
    unbiased std of the union (float64 sums over the ranks), applied to this rank's rows."""
    m = mask > 0
    picked = values[m].double()
    count, total = dist.sum([picked.numel(), float(picked.sum())])
    if count == 0:
        return torch.zeros_like(values)
    mean = total / count
    (squares,) = dist.sum([float(((picked - mean) ** 2).sum())])
    sd = math.sqrt(squares / (count - 1)) if count > 1 else 1.0
    return torch.where(m, (values - mean) / (sd + eps), torch.zeros_like(values))


def _rows_of_all_ranks(dist: Dist, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[B, T]`` tensors of every rank stacked by rows in rank order (each padded with zeros
    to the widest rank's ``T``), on this rank's device."""
    if dist.world == 1:
        return tensors
    parts = dist.gather([t.detach().cpu() for t in tensors])
    width = max(p[0].shape[1] for p in parts)
    out = []
    for i, t in enumerate(tensors):
        rows = [torch.nn.functional.pad(p[i], (0, width - p[i].shape[1])) for p in parts]
        out.append(torch.cat(rows).to(t.device))
    return tuple(out)


def _cat_of_all_ranks(dist: Dist, values: torch.Tensor) -> torch.Tensor:
    """``[B]`` tensors of every rank concatenated in rank order, on this rank's device."""
    if dist.world == 1:
        return values
    return torch.cat(dist.gather(values.detach().cpu())).to(values.device)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _rollout_metrics(completions, rewards: torch.Tensor) -> dict[str, float]:
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


