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

Each stage is a module of functions that take what they need as arguments (setup: ``build``,
1-3: ``collect``, 4: ``scoring``, 5-6: ``update``, 8: ``step_metrics``, ``evaluation``,
``checkpointing``; ``memory_policy``); this module wires them into the loop.

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
import time
from pathlib import Path

import torch

from quarl.config import RunConfig
from quarl.distributed import from_env
from quarl.learner.batch import RolloutBatch, build_batch
from quarl.quant import QuantMode
from quarl.runtime import process_totals
from quarl.tasks.rewards import ScoringInterrupted
from quarl.trainer import oom
from quarl.trainer.build import build_components, seed_everything, start_logging
from quarl.trainer.checkpointing import RunPosition, preflight, restore, save
from quarl.trainer.collect import PromptStream, RolloutCollector
from quarl.trainer.evaluation import evaluation_of, release_after_forward
from quarl.trainer.exact_check import exact_warning, first_parting, parting_layer
from quarl.trainer.faults import EvaluationFailed, rolled_back_on_verifier_failure
from quarl.trainer.interrupt import GracefulStop
from quarl.trainer.memory_policy import larger_cache
from quarl.trainer.notices import Notices
from quarl.trainer.progress import StepProgress
from quarl.trainer.ranks import union_of_ranks
from quarl.trainer.scoring import batch_with_advantages
from quarl.trainer.setup import resolve_runtime
from quarl.trainer.stages import ErrorScan, Rollout, StageClock, UpdateResult
from quarl.trainer.step_metrics import find_errors, flag_limit, perf_metrics, step_metrics, warn_about_step
from quarl.trainer.update import TrainingAborted, check_finite, update_policy, update_settings

__all__ = ["Trainer", "TrainingAborted"]


class Trainer:
    """One RL run in ``cfg.trainer.run_dir``.

    resume: continue from the newest checkpoint that loads (step 0 when the run has
        none); settings that changed since are checked by
        :func:`quarl.trainer.resume.check_config_change`, refused unless
        ``allow_config_change``. Nothing in the run directory is written before the
        checkpoint has loaded.
    evaluation_only: load the run's checkpoint to evaluate it; writes no run files (config, metrics).
        (``quarl eval`` builds less: :func:`quarl.trainer.evaluation.build_for_evaluation`.)
    """

    # while run() trains in one process: whether a stop was asked for (the verifier's pool stops waiting)
    _stop_hook = None

    def __init__(self, cfg: RunConfig, resume: bool = False, console=None, evaluation_only: bool = False,
                 allow_config_change: bool = False) -> None:
        began = time.perf_counter()
        self.cfg, self.run_dir = cfg, Path(cfg.trainer.run_dir)
        self.dist = from_env(cfg.trainer.device)
        self.dist.share(cfg.trainer.prompts_per_step)  # a step's prompts must split evenly over the ranks
        self.console = console if self.dist.main else None
        self.notices = Notices(self.console, self.dist.main)
        self.device, self.dtype = resolve_runtime(cfg)
        found = preflight(self.run_dir, cfg, resume, evaluation_only, allow_config_change, self.notices)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.trainer.seed)

        parts = build_components(cfg, self.dist, self.device, self.dtype, self.run_dir, self.notices,
                                 resuming=found is not None)
        data = parts.data
        self.tokenizer, self.task, self.rewards = data.tokenizer, data.task, data.rewards
        self.train_examples, self.eval_examples = data.train_examples, data.eval_examples
        self.engine, self.publisher, self.learner = parts.engine, parts.publisher, parts.learner
        self.memory, self.work = parts.memory, parts.work
        self.prompts = PromptStream(self.train_examples, self.tokenizer, self.task, cfg.data)
        self.collector = RolloutCollector(cfg.rollout, cfg.trainer, self.engine, self.tokenizer, self.rewards,
                                          self.prompts, self.dist)
        self.evaluation = evaluation_of(cfg, self.engine, data, self.dist)
        self.interrupted = False
        self._flagged_samples: list[dict] = []  # the last step's flagged responses, for samples.jsonl
        self._exact_located = False  # exact mode: the stage where the forwards part was looked for
        self._in_flight: int | None = None  # the step being computed, for the interrupt message
        # where the run stands: its checkpoint's position (in the learner and the random state too)
        at = restore(found, self.learner, cfg, self.run_dir, self.notices, quarantine=not evaluation_only,
                     on_misfit=self.rewards.close) if found is not None else RunPosition()
        self.step, self.prompts.position, self.bad_steps = at.step, at.data_pos, at.bad_steps
        self._saved_step: int | None = self.step if found is not None else None
        start_step = self.step if resume else None
        # written only now: the checkpoint (if any) has loaded
        self.logger = start_logging(self.run_dir, cfg, start_step) if not evaluation_only and self.dist.main \
            else None
        self.publisher.publish()  # the engine starts from exactly the learner's weights
        self.sync_error = self._check_engine_sync()
        # building the run (data, base, engine, learner) in this process: the first row logged reports it
        self._setup_s: float | None = time.perf_counter() - began

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
                        with rolled_back_on_verifier_failure(self.prompts, self.step, lambda: self._saved_step,
                                                             self.save, self.run_dir):
                            last = self._step_and_log()
                    except ScoringInterrupted:
                        self.notices.warn(f"step {self._in_flight} abandoned: its verifier was still busy; a resume "
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
            self.notices.warn(f"evaluation of step {self.step} skipped: its verifier was still busy when asked to stop")
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

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """One step: rollout -> score -> update -> publish; returns its metrics."""
        clock, totals_before = StageClock(self.device), process_totals()
        held = oom.MemoryState(kv_kept=self.memory.keep_kv is True, world=self.dist.world,
                               sharded=self.learner.sharded)
        with oom.naming_the_stage(clock, self.step + 1, self.cfg, held), clock.stage("step"):
            rollout, preempted = self.collector.collect(self.step, clock, self._stop_hook)      # 1-3
            # every rank's preemptions: the sum is where a rank waits for the slowest rank's
            # rollout (timed on its own; else it falls into the learner's first collective)
            with clock.stage("rank_wait") if self.dist.world > 1 else contextlib.nullcontext():
                (preempted,) = self.dist.sum([preempted])
            batch = batch_with_advantages(rollout, self.cfg.algo, self.cfg.rollout.n,          # 4
                                          self.cfg.trainer.overlong_filter).to(self.device)
            release = not self.memory.keep_kv
            with clock.stage("kv_cache"):
                if release:
                    self.engine.release_kv_cache()
            with clock.stage("learner", memory=True):
                update, scan = self.update_policy(batch)                                       # 5-6
            with clock.stage("publish"):  # (before the KV cache returns: a sharded publish gathers whole tensors)
                quant_metrics = self.publisher.publish()                                       # 7
            with clock.stage("kv_cache"):
                if release:
                    self.engine.reallocate_kv_cache()
        self.memory.after_learner(clock.peak_gb.get("learner", 0.0), kv_counted=not release)
        self.bad_steps = check_finite(update, self.learner, self.bad_steps, self.cfg.trainer.max_bad_steps,
                                      self.step + 1, self.notices)
        return self._step_metrics(rollout, batch, update, scan, quant_metrics, clock, int(preempted), totals_before)

    def update_policy(self, batch: RolloutBatch) -> tuple[UpdateResult, ErrorScan | None]:
        """Stages 5-6 (:func:`quarl.trainer.update.update_policy`)."""
        return update_policy(batch, self.learner, self.cfg.algo, update_settings(self.cfg), self.dist,
                             exact=self.cfg.quant.exact)

    def _step_metrics(self, rollout: Rollout, batch: RolloutBatch, update: UpdateResult, scan: ErrorScan | None,
                      quant_metrics: dict[str, float], clock: StageClock, preempted: int,
                      totals_before: dict[str, float]) -> dict[str, float]:
        """The step's row, over every rank's rollouts (8); keeps its flagged responses for samples.jsonl."""
        t = self.cfg.trainer
        union = union_of_ranks(self.dist, rollout)
        learner_logp = batch.old_logp if batch.old_logp is not None else self.learner.last_logp
        errors, self._flagged_samples = find_errors(
            batch, rollout, union, learner_logp, scan, self.cfg.algo, t.overlong_filter,
            flag_limit(t.log_samples, self.logger is not None), self.dist, self.tokenizer)
        timing, packing = clock.metrics(), self.learner.last_packing
        perf = perf_metrics(update, timing["time/learner"], self.work, self.dist.world, totals_before, packing)
        runner = self.engine.runner
        warn_about_step(self.notices, self.step + 1, preempted, runner.num_blocks * runner.block_size,
                        larger_cache(self.cfg.rollout.engine, self.device, runner.num_blocks), packing,
                        self.device.type == "cuda")
        if self.cfg.quant.exact:
            self._check_exact(batch, learner_logp, update.mismatch["mismatch/max_abs_logp_diff"])
        return step_metrics(union, update, errors, quant_metrics, timing, perf, preempted,
                            self.learner.scheduler.get_last_lr()[0], self.bad_steps)

    def _check_exact(self, batch: RolloutBatch, learner_logp: torch.Tensor, max_diff: float) -> None:
        """Exact mode: a step whose log-probs parted is a warning naming the first token and,
        the first time in a run, the stage where the two forwards part (:mod:`.exact_check`)."""
        if not max_diff > 0:
            return
        parting = first_parting(batch.input_ids, learner_logp, batch.sampler_logp, batch.response_mask)
        layer = None
        if parting is not None and not self._exact_located:
            self._exact_located = True
            ids = batch.input_ids[parting.row, : parting.position + 2].tolist()
            try:
                layer = parting_layer(self.engine, self.learner.model, ids, parting.position)
            except (RuntimeError, ValueError) as e:
                layer = f"(not located: {e})"
        self.notices.warn(exact_warning(self.step + 1, max_diff, parting, layer))

    # ------------------------------------------------------------------ eval and checkpoints
    def evaluate(self, log: bool = True) -> dict[str, float]:
        """Greedy accuracy of the engine on the eval split (and the learner's on its worked solutions)."""
        metrics, samples = self.evaluation.run(self.learner.model, self._stop_hook,
                                               release_after_forward(self.learner))
        if log and self.logger is not None and self.eval_examples:
            self.logger.log_samples(self.step, samples)
        return metrics

    def save(self) -> Path:
        """This step's checkpoint (:func:`quarl.trainer.checkpointing.save`)."""
        path = save(self.run_dir, RunPosition(self.step, self.prompts.position, self.bad_steps), self.learner,
                    self.cfg, self.dist)
        self._saved_step = self.step
        return path
