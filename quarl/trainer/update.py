"""Stages 5-6 of a step: the learner's old / reference log-probs where the update needs them,
the tokens the mismatch correction (and ``algo.truncate_at_error``) takes out, then
``ppo_epochs`` x ``mini_batches`` steps of the configured loss.

An MoE policy whose batch has the engine's routes also gets its ``moe/*`` metrics: the route
agreement is counted in a pass where the policy routes itself (without replay: the pass whose
log-probs give the mismatch metrics, the old-logp pass or the update's own forward; with
``rollout.routing_replay=r3``: one extra no-grad pass without replay before the update, whose
log-probs also give ``mismatch/kl_k3_noreplay``), docs/configuration.md."""

from __future__ import annotations

import math

import torch

from quarl.algos import before_error, compute_gae, last_token_rewards, mismatch_metrics, whiten
from quarl.algos.corrections import CorrectionSpec, mismatch_correction
from quarl.algos.losses import policy_loss_defaults, positive_advantage_mask
from quarl.config.run import AlgoConfig, RunConfig
from quarl.distributed import Dist
from quarl.learner.batch import RolloutBatch
from quarl.learner.learner import Learner, UpdateSettings
from quarl.trainer.error_tokens import error_rows
from quarl.trainer.notices import Notices
from quarl.trainer.ranks import rows_of_all_ranks
from quarl.trainer.stages import ErrorScan, UpdateResult


class TrainingAborted(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def update_settings(cfg: RunConfig) -> UpdateSettings:
    """The learner's settings of one update: the loss's own hyperparameters of ``cfg.algo``,
    the update's shape (``trainer.on_policy``: one epoch of one mini-batch), budget and clip."""
    a, t = cfg.algo, cfg.trainer
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
        token_budget=t.token_budget, temperature=cfg.rollout.temperature,
        grad_clip=cfg.optim.grad_clip, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
        value_coef=a.value_coef,
    )


def update_policy(batch: RolloutBatch, learner: Learner, algo: AlgoConfig, settings: UpdateSettings,
                  dist: Dist, exact: bool = False) -> tuple[UpdateResult, ErrorScan | None]:
    """Stages 5-6 on ``batch`` (on the learner's device): the update's result, and where its
    truncation at error tokens found them (None without ``algo.truncate_at_error``).

    ``exact`` (``quant.exact``): the learner's log-probs of the sampled tokens under the
    weights that sampled them are the sampler's, bit for bit; an update of one epoch of one
    mini-batch whose correction rejects needs them before it, and takes the sampler's
    instead of an old-logp pass (every ratio is then 1: nothing is removed, as an exact step
    removes nothing); its own forward, under the same weights, still gives the mismatch
    metrics that check the claim. (The error-token truncation keeps the pass: it removes
    tokens whose own log-probs the update's forward then does not report.)"""
    budget, temp = settings.token_budget, settings.temperature
    spec = algo.correction_spec()
    removes = spec.rejects or algo.truncate_at_error
    # an MoE batch with the engine's routes: where the policy's own routing is counted (module docstring)
    tally = learner.route_tally() if batch.routes is not None else None
    replayed = tally is not None and learner.routing_replay
    one_pass = (settings.ppo_epochs, settings.mini_batches) == (1, 1)
    borrowed = exact and one_pass and spec.rejects and not algo.truncate_at_error
    # else the update's own forward gives old_logp; what the update removes is known before
    # it (from old_logp), so that every micro-batch's share of the loss counts kept tokens
    if borrowed:
        batch.old_logp = batch.sampler_logp
    elif not one_pass or removes:
        batch.old_logp = learner.logprobs(batch, budget, temp, tally=None if replayed else tally)
    if algo.kl_coef > 0:
        batch.ref_logp = learner.logprobs(batch, budget, temp, ref=True)
    # with replay, the policy's log-probs routing itself, before the update moves it
    free_logp = learner.logprobs(batch, budget, temp, replay=False, tally=tally) if replayed else None
    returns = gae(batch, learner, algo, budget, dist) if algo.advantage == "gae" else None
    extra = (batch.old_logp is not None and not borrowed) + (batch.ref_logp is not None) + (returns is not None) + \
        (free_logp is not None)
    update_tally = tally if tally is not None and not replayed and (batch.old_logp is None or borrowed) else None
    full_mask = batch.response_mask
    removed: dict[str, float] = {}
    scan = None
    if removes:
        batch.response_mask, removed, scan = removals(batch, spec, algo, dist)
    if algo.loss == "positive_only" and returns is None:
        # its A < 0 responses leave the mask up front too, so that the micro-batches' shares of the
        # loss count the responses it trains on (with GAE the critic needs every token: the loss drops them)
        kept = positive_advantage_mask(batch.advantages, batch.response_mask)
        tokens, n_kept = dist.sum([float(batch.response_mask.sum()), float(kept.sum())])
        batch.response_mask = kept
        removed["positive_only/drop_frac"] = 1.0 - n_kept / max(tokens, 1.0)
    metrics = learner.update(batch, settings, returns, tally=update_tally)
    batch.response_mask = full_mask
    if borrowed:  # what the learner computed is the update's own forward's (the step's metrics read it)
        batch.old_logp = None
    metrics.update(removed)
    old_logp = batch.old_logp if batch.old_logp is not None else learner.last_logp
    rows = rows_of_all_ranks(dist, old_logp, batch.sampler_logp, batch.response_mask)
    mismatch = mismatch_metrics(*rows)
    if free_logp is not None:
        free_rows = rows_of_all_ranks(dist, free_logp, batch.sampler_logp, batch.response_mask)
        mismatch["mismatch/kl_k3_noreplay"] = mismatch_metrics(*free_rows)["mismatch/kl_k3"]
    if tally is not None:
        mismatch.update(tally.metrics(dist, learner.model.config.num_experts_per_tok))
    (tokens,) = dist.sum([int(batch.attention_mask.sum())])
    return UpdateResult(metrics, mismatch, tokens=int(tokens), extra_forwards=int(extra)), scan


def removals(batch: RolloutBatch, spec: CorrectionSpec, algo: AlgoConfig, dist: Dist
             ) -> tuple[torch.Tensor, dict[str, float], ErrorScan | None]:
    """The response mask less the tokens the correction's rejection and veto remove and,
    with ``algo.truncate_at_error``, less every token from a response's first error token
    on; with the shares removed over every rank (``correction/drop_frac``: tokens the
    correction removed, ``correction/row_drop_frac``: responses it emptied,
    ``errors/truncated_frac``: tokens the truncation removed besides), and where the
    truncation found the error tokens (None without it)."""
    mask = batch.response_mask
    kept = mismatch_correction(spec, batch.old_logp, batch.sampler_logp, mask).keep.to(mask.dtype)
    truncated, scan = kept, None
    if algo.truncate_at_error:
        loops, garbled = error_rows(batch.input_ids, batch.old_logp, batch.sampler_logp, mask, algo)
        scan = ErrorScan(mask, loops, garbled)  # the step's errors/* metrics reuse it
        truncated = before_error(kept, torch.minimum(loops, garbled))
    rows = mask.sum(-1) > 0
    counts = torch.stack([mask.sum(), kept.sum(), truncated.sum(), rows.sum(), (rows & (kept.sum(-1) > 0)).sum()])
    tokens, n_kept, n_truncated, n_rows, n_kept_rows = dist.sum(counts.double().tolist())
    return truncated, {
        "correction/drop_frac": 1.0 - n_kept / max(tokens, 1.0),
        "correction/row_drop_frac": 1.0 - n_kept_rows / max(n_rows, 1.0),
        "errors/truncated_frac": (n_kept - n_truncated) / max(tokens, 1.0),
    }, scan


def gae(batch: RolloutBatch, learner: Learner, algo: AlgoConfig, token_budget: int, dist: Dist) -> torch.Tensor:
    """Token-level advantages from the critic, whitened over every rank's response tokens,
    written into ``batch``; returns the critic's targets."""
    mask = batch.response_mask
    values = learner.values(batch, token_budget)
    adv, returns = compute_gae(last_token_rewards(batch.rewards, mask), values, mask, algo.gamma, algo.lam)
    batch.advantages = whiten(adv, mask) if dist.world == 1 else whiten_over_ranks(dist, adv, mask)
    return returns


def whiten_over_ranks(dist: Dist, values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
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


def check_finite(update: UpdateResult, learner: Learner, bad_steps: int, max_bad_steps: int, step: int,
                 notices: Notices) -> int:
    """The count of consecutive skipped updates after step ``step`` (``update``'s): reset by a
    finite one; :class:`TrainingAborted` once it reaches ``max_bad_steps``."""
    if not update.metrics.get("train/skipped_updates", 0) > 0:
        return 0
    bad_steps += 1
    bad = learner.last_nonfinite + sorted(k for k, v in update.mismatch.items() if not math.isfinite(v))
    notices.say(f"[yellow]step {step}: non-finite loss or gradient ({', '.join(bad) or 'grad_norm'}), "
                f"update skipped ({bad_steps} in a row)[/yellow]")
    if bad_steps >= max_bad_steps:
        raise TrainingAborted(
            f"{bad_steps} consecutive steps had a non-finite loss or gradient "
            f"(last: {', '.join(bad) or 'grad_norm'}); lower optim.lr "
            "or check the data (the last good checkpoint is intact)"
        )
    return bad_steps
