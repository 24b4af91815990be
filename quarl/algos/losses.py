"""Policy losses: pure functions of ``[B, T]`` log-prob tensors (docs/design.md, "Algorithms").

Inputs shared by every loss (their names say whose numbers they are):

- ``logp [B, T]``         current learner log-probs of the sampled tokens; the only
                          input the gradient flows through.
- ``old_logp [B, T]``     learner at the start of the step (the proximal policy).
- ``sampler_logp [B, T]`` log-probs returned by the (low-bit) rollout engine.
- ``advantages``          ``[B]`` (one per response, broadcast to its tokens); the
                          token-level losses also take ``[B, T]`` (GAE with a critic).
- ``mask [B, T]``         1.0 on response tokens, 0.0 on prompt and padding.

With ``R = exp(logp - old_logp)`` the token ratio and ``w = exp(old_logp - sampler_logp)``
the detached mismatch weight (see :mod:`quarl.algos.corrections`):

token level, reduced by :func:`quarl.algos.aggregation.agg_loss`
    ``ppo``            ``-min(R A, clip(R, 1-eps_low, 1+eps_high) A)`` (GRPO / DAPO; QuRL
                       eq. 1), times the correction weight; ``dual_clip_c`` (Ye et al.
                       2020) caps the loss of A < 0 tokens at ``-c A``.
    ``positive_only``  ``ppo`` on the tokens with A >= 0 only.
    ``sapo``           ``-(4/tau) sigmoid(tau (R - 1)) A``, tau = tau_pos (A > 0) or
                       tau_neg (A < 0): a soft gate instead of a hard clip.

sequence level, summed over responses and divided by N = B (rows with no response
tokens contribute 0 but count in N; so do dropped responses)
    ``gspo``           ``s = exp(mean_t(logp - old_logp))``,
                       ``-min(s A, clip(s, 1-eps_low, 1+eps_high) A)`` times the
                       sequence correction.
    ``tbpo``           QaRL section 3.2, eq. 5-6: ``-keep * v * r * A`` with
                       ``r = exp(mean_t(logp - old_logp))``, ``v`` the seq-tis weight
                       and ``keep`` the trust band (``r <= 1+eps_high`` if A > 0,
                       ``1-delta_low <= r <= 1+delta_high`` if A < 0).

Every loss returns ``(loss, metrics)``: ``loss`` a scalar tensor, ``metrics`` a dict of
detached 0-d tensors (:func:`compute_policy_loss` turns them into floats with one host
sync, or hands them over as they are) that always holds ``loss/policy``, ``loss/clip_frac`` (share of tokens -- or of
responses, for sequence losses -- whose gradient a clip or band cut),
``loss/ratio_mean``, ``loss/ratio_max``, ``correction/w_mean``, ``correction/w_max``
(the applied correction weights) and ``correction/drop_frac`` (share removed by
IcePop / MIS), plus loss-specific names.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from quarl.algos.aggregation import _masked, agg_loss, check_agg, masked_max, masked_mean, response_rows, seq_mean
from quarl.algos.corrections import (
    LEVELS,
    SEQ_CORRECTIONS,
    TOKEN_CORRECTIONS,
    Correction,
    CorrectionSpec,
    mismatch_correction,
    preset,
)

# log-ratios are clamped before exp so that a wild token cannot overflow to inf (whose
# gradient would be NaN); e^20 is far outside every clip range used here.
_MAX_LOG_RATIO = 20.0
# the importance-weight levels a sequence-level loss takes (one weight per response)
ROW_WEIGHTS: tuple[str, ...] = ("none", "sequence", "geometric")

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


# ---------------------------------------------------------------- shared pieces


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype)


def _token_advantages(
    advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Detached ``[B, T]`` advantages, 0 off the mask (so padding cannot poison gradients)."""
    adv = advantages.detach().to(logp.dtype)
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    return _masked(adv, mask)


def _token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``R = exp(logp - old_logp)`` ``[B, T]``; exactly 1 off the mask."""
    log_ratio = _masked(logp - old_logp.detach(), mask)
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _seq_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(mean_t(logp - old_logp))`` ``[B]``; 1 for empty rows."""
    log_ratio = seq_mean(logp - old_logp.detach(), mask)
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    low: float,
    high: torch.Tensor | float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate ``max(-R A, -clip(R, low, high) A)`` (as a loss).

    Returns ``(loss, cut)`` of ``ratio``'s shape; ``cut`` marks entries whose gradient
    is zero because the clipped branch (or the dual clip ``-c A`` for A < 0) won.
    """
    high = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
    clipped_ratio = torch.minimum(ratio.clamp(min=low), high)
    unclipped = -adv * ratio
    clipped = -adv * clipped_ratio
    cut = clipped > unclipped
    loss = torch.where(cut, clipped, unclipped)
    if dual_clip_c is not None:
        ceiling = -dual_clip_c * adv
        dual = (adv < 0) & (loss > ceiling)
        loss = torch.where(dual, ceiling, loss)
        cut = cut | dual
    return loss, cut


def _frac(flags: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """Share of ``over`` entries where ``flags`` is set (0 when ``over`` is empty)."""
    over = over.bool()
    return (flags.bool() & over).sum().double() / over.sum().clamp(min=1).double()


def _scalars(metrics: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metrics as detached 0-d float64 tensors on their device (no host sync)."""
    return {n: v.detach().double().reshape(()) for n, v in metrics.items()}


def floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors to floats with one host sync for all of them."""
    names = list(metrics)
    if not names:
        return {}
    values = torch.stack([metrics[n].detach().double().reshape(()) for n in names]).tolist()
    return dict(zip(names, values))


def _check_eps(**eps: float) -> None:
    for name, value in eps.items():
        if not value >= 0.0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if eps.get("eps_low", 0.0) >= 1.0 or eps.get("delta_low", 0.0) >= 1.0:
        raise ValueError("the lower clip distance must be < 1")


Corrections = str | CorrectionSpec


def _correction(correction: Corrections, cap: float, presets: tuple[str, ...], weights: tuple[str, ...],
                adaptive_clip: bool, old_logp, sampler_logp, mask) -> tuple[Correction, torch.Tensor]:
    """The correction (a preset name among ``presets`` or a :class:`CorrectionSpec` whose
    weights level is among ``weights``) and the mask of the tokens it keeps (``mask``'s dtype)."""
    if isinstance(correction, str):
        if correction not in presets:
            raise ValueError(f"unknown correction {correction!r}; valid: {', '.join(presets)}")
        spec = preset(correction, cap)
    else:
        spec = correction
    if spec.weights not in weights:
        raise ValueError(f"this loss takes {', '.join(weights)} importance weights, got {spec.weights!r}")
    if spec.adaptive_clip and not adaptive_clip:
        raise ValueError("the adaptive clip (acr) needs a loss with a hard clip (ppo, positive_only)")
    corr = mismatch_correction(spec, old_logp, sampler_logp, mask)
    return corr, corr.keep.to(mask.dtype)


def _token_metrics(loss, clip_frac, ratio, corr, mask, kept) -> dict[str, torch.Tensor]:
    """The metrics every token-level loss reports (values still on the device): the ratio
    and weight statistics over the kept tokens, the share removed over ``mask``."""
    return {
        "loss/policy": loss,
        "loss/clip_frac": clip_frac,
        "loss/ratio_mean": masked_mean(ratio, kept),
        "loss/ratio_max": masked_max(ratio, kept),
        "correction/w_mean": masked_mean(corr.weight, kept),
        "correction/w_max": masked_max(corr.weight, kept),
        "correction/drop_frac": _frac(kept == 0, mask),
    }


# ---------------------------------------------------------------- token-level losses


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip_c: float | None = None,
    correction: Corrections = "none",
    cap: float = 2.0,
    agg: str = "token-mean",
    max_len: int | None = None,
) -> LossOutput:
    """Clipped PPO / GRPO / DAPO surrogate with a mismatch correction (QuRL eqs. 1, 4, 5, 9).

    Per token: ``c_t * max(-R A, -clip(R, 1-eps_low, hi_t) A)`` where ``c_t`` is the
    correction weight and ``hi_t = 1+eps_high`` except under ``acr``, where
    ``hi_t = (1+eps_high) / min(1, cap / w)`` (QuRL eq. 9). With ``dual_clip_c = c > 1``
    the loss of A < 0 tokens is ``min(that, -c A)``. ``correction``: a token-level preset
    or any :class:`CorrectionSpec`; the tokens it removes leave the loss and its
    denominators. Shapes: module docstring; ``agg``/``max_len``: :func:`agg_loss`.
    """
    _check_eps(eps_low=eps_low, eps_high=eps_high)
    check_agg(agg)
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c}")
    mask = _float_mask(mask, logp)
    corr, kept = _correction(correction, cap, TOKEN_CORRECTIONS, LEVELS, True, old_logp, sampler_logp, mask)
    adv = _token_advantages(advantages, logp, kept)
    ratio = _token_ratio(logp, old_logp, kept)
    high = (1.0 + eps_high) * corr.upper_scale
    surrogate, cut = _clipped_surrogate(ratio, adv, 1.0 - eps_low, high, dual_clip_c)
    loss = agg_loss(corr.weight * surrogate, kept, agg, max_len)
    with torch.no_grad():
        metrics = _token_metrics(loss, _frac(cut, kept), ratio, corr, mask, kept)
    return loss, _scalars(metrics)


def positive_advantage_mask(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` less every token whose advantage is negative (``[B]`` advantages: whole
    responses); what ``positive_only`` trains on."""
    adv = advantages.detach()
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    return mask * (adv >= 0).to(mask.dtype)


def positive_only_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **ppo_hparams,
) -> LossOutput:
    """``ppo`` with every A < 0 response (token, for ``[B, T]`` advantages) masked out.

    The dropped tokens leave the loss and its denominators (under the ``seq-mean-*`` modes
    their rows leave the row count). Reports ``positive_only/drop_frac``, the share of
    response tokens removed. Hyperparameters: those of :func:`ppo_loss`.
    """
    mask = _float_mask(mask, logp)
    kept = positive_advantage_mask(advantages, mask)
    loss, metrics = ppo_loss(logp, old_logp, sampler_logp, advantages, kept, **ppo_hparams)
    with torch.no_grad():
        metrics["positive_only/drop_frac"] = _frac(kept == 0, mask)
    return loss, metrics


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    correction: Corrections = "none",
    cap: float = 2.0,
    agg: str = "token-mean",
    max_len: int | None = None,
) -> LossOutput:
    """Soft adaptive policy optimization: ``c_t * -(4/tau) sigmoid(tau (R - 1)) A``.

    The gate replaces PPO's hard clip: ``d loss / d logp = -4 s (1 - s) R A`` with
    ``s = sigmoid(tau (R - 1))``, i.e. exactly the policy gradient ``-A`` at R = 1 and
    smoothly fading away from it (faster for A < 0, tau_neg > tau_pos). Nothing is cut,
    so ``loss/clip_frac`` is 0; ``sapo/gate_mean`` is the mean of ``4 s (1 - s)``.
    ``correction``: none | tis | decoupled | icepop or a :class:`CorrectionSpec` without the
    adaptive clip (ACR needs a hard clip).
    """
    check_agg(agg)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    mask = _float_mask(mask, logp)
    presets = tuple(p for p in TOKEN_CORRECTIONS if p != "acr")
    corr, kept = _correction(correction, cap, presets, LEVELS, False, old_logp, sampler_logp, mask)
    adv = _token_advantages(advantages, logp, kept)
    ratio = _token_ratio(logp, old_logp, kept)
    tau = torch.where(adv < 0, torch.full_like(adv, tau_neg), torch.full_like(adv, tau_pos))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = agg_loss(corr.weight * (-(4.0 / tau) * gate * adv), kept, agg, max_len)
    with torch.no_grad():
        metrics = _token_metrics(loss, logp.new_zeros(()), ratio, corr, mask, kept)
        metrics["sapo/gate_mean"] = masked_mean(4.0 * gate * (1.0 - gate), kept)
    return loss, _scalars(metrics)


# ---------------------------------------------------------------- sequence-level losses


def _seq_advantages(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    if advantages.dim() != 1:
        raise ValueError(
            f"sequence-level losses need one advantage per response [B]; got {tuple(advantages.shape)}"
        )
    return advantages.detach().to(logp.dtype)


def _seq_stats(
    ratio: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    return {
        "loss/ratio_mean": masked_mean(ratio, valid),
        "loss/ratio_max": masked_max(ratio, valid),
        "correction/w_mean": masked_mean(weight, valid),
        "correction/w_max": masked_max(weight, valid),
    }


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    correction: Corrections = "none",
    cap: float = 2.0,
) -> LossOutput:
    """Group sequence policy optimization (Zheng et al. 2025) with a sequence correction.

    ``s_i = exp(mean_t(logp - old_logp))``; loss
    ``(1/N) sum_i v_i * max(-s_i A_i, -clip(s_i, 1-eps_low, 1+eps_high) A_i)`` with
    ``v_i`` from ``correction`` (none | seq-tis | mis, or a :class:`CorrectionSpec` with
    sequence or geometric weights, :mod:`quarl.algos.corrections`) and N the responses
    with tokens left after the correction's removals (which leave ``mean_t`` too).
    ``advantages``: ``[B]``. ``loss/clip_frac`` is the share of those responses clipped;
    ``correction/drop_frac`` the share of response tokens removed.
    """
    _check_eps(eps_low=eps_low, eps_high=eps_high)
    adv = _seq_advantages(advantages, logp)
    mask = _float_mask(mask, logp)
    corr, kept = _correction(correction, cap, SEQ_CORRECTIONS, ROW_WEIGHTS, False, old_logp, sampler_logp, mask)
    valid = kept.sum(-1) > 0
    ratio = _seq_ratio(logp, old_logp, kept)
    surrogate, cut = _clipped_surrogate(ratio, adv, 1.0 - eps_low, 1.0 + eps_high)
    per_response = _masked(corr.row_weight * surrogate, valid)
    loss = per_response.sum() / response_rows(kept).to(logp.dtype).clamp(min=1.0)
    with torch.no_grad():
        metrics = {
            "loss/policy": loss,
            "loss/clip_frac": _frac(cut, valid),
            **_seq_stats(ratio, corr.row_weight, valid),
            "correction/drop_frac": _frac(kept == 0, mask),
        }
    return loss, _scalars(metrics)


def tbpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_high: float = 4e-4,
    delta_low: float = 3e-4,
    delta_high: float = 7e-4,
    correction: Corrections = "seq-tis",
    cap: float = 2.0,
) -> LossOutput:
    """Trust-band policy optimization (QaRL section 3.2, eqs. 5-6).

    ``r_i = exp(mean_t(logp - old_logp))`` carries the gradient;
    ``v_i = exp(clamp(mean_t(old_logp - sampler_logp), -log cap, log cap))`` (detached; the
    ``seq-tis`` correction, or another sequence-level one, e.g. asymmetric bounds or a
    rejection, as a :class:`CorrectionSpec`);
    ``keep_i = r_i <= 1 + eps_high`` if A_i > 0, ``1 - delta_low <= r_i <= 1 + delta_high``
    if A_i < 0 (the dual band that stops low-probability error tokens of negative
    responses from dominating); loss ``= -(1/N) sum_i keep_i v_i r_i A_i`` with N the
    responses with tokens (a band-dropped response counts in N; one the correction removed
    does not). A dropped response contributes neither value nor gradient. ``advantages``: ``[B]``.
    Reports ``tbpo/drop_frac_pos`` / ``tbpo/drop_frac_neg`` (band-dropped share of the A > 0 /
    A < 0 responses) and ``loss/clip_frac`` (band-dropped share of all of them).
    """
    _check_eps(eps_high=eps_high, delta_low=delta_low, delta_high=delta_high)
    adv = _seq_advantages(advantages, logp)
    mask = _float_mask(mask, logp)
    corr, kept = _correction(correction, cap, SEQ_CORRECTIONS, ROW_WEIGHTS, False, old_logp, sampler_logp, mask)
    valid = kept.sum(-1) > 0
    v = corr.row_weight
    ratio = _seq_ratio(logp, old_logp, kept)
    with torch.no_grad():
        r = ratio.detach()
        in_neg_band = (r >= 1.0 - delta_low) & (r <= 1.0 + delta_high)
        keep = torch.where(adv > 0, r <= 1.0 + eps_high, torch.where(adv < 0, in_neg_band, True))
        keep = keep & valid
    loss = _masked(-v * ratio * adv, keep).sum() / response_rows(kept).to(logp.dtype).clamp(min=1.0)
    with torch.no_grad():
        dropped = valid & ~keep
        metrics = {
            "loss/policy": loss,
            "loss/clip_frac": _frac(dropped, valid),
            **_seq_stats(ratio, v, valid),
            "correction/drop_frac": _frac(kept == 0, mask),
            "tbpo/drop_frac_pos": _frac(dropped, valid & (adv > 0)),
            "tbpo/drop_frac_neg": _frac(dropped, valid & (adv < 0)),
        }
    return loss, _scalars(metrics)


# ---------------------------------------------------------------- registry and entry point

POLICY_LOSS_FNS: dict[str, Callable[..., LossOutput]] = {
    "ppo": ppo_loss,
    "positive_only": positive_only_loss,
    "sapo": sapo_loss,
    "gspo": gspo_loss,
    "tbpo": tbpo_loss,
}
POLICY_LOSSES: tuple[str, ...] = tuple(POLICY_LOSS_FNS)
SEQUENCE_LOSSES: tuple[str, ...] = ("gspo", "tbpo")


def policy_loss_defaults(loss_type: str) -> dict[str, object]:
    """The hyperparameters ``loss_type`` accepts, with their defaults."""
    fn = _lookup(loss_type)
    if fn is positive_only_loss:
        fn = ppo_loss
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _lookup(loss_type: str) -> Callable[..., LossOutput]:
    if loss_type not in POLICY_LOSS_FNS:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSS_FNS[loss_type]


def _check_shapes(loss_type: str, tensors: dict[str, torch.Tensor], advantages: torch.Tensor) -> None:
    shape = tensors["logp"].shape
    if len(shape) != 2:
        raise ValueError(f"logp must be [B, T], got {tuple(shape)}")
    for name, t in tensors.items():
        if t.shape != shape:
            raise ValueError(f"{name} must have logp's shape {tuple(shape)}, got {tuple(t.shape)}")
    allowed = [shape[:1]] + ([] if loss_type in SEQUENCE_LOSSES else [shape])
    if advantages.shape not in allowed:
        want = " or ".join(str(tuple(s)) for s in allowed)
        raise ValueError(f"advantages for {loss_type!r} must be {want}, got {tuple(advantages.shape)}")


def compute_policy_loss(
    loss_type: str,
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    on_device: bool = False,
    **hparams,
) -> tuple[torch.Tensor, dict[str, float]] | LossOutput:
    """Policy loss ``loss_type`` (one of :data:`POLICY_LOSSES`) and its metrics.

    Shapes: ``logp``, ``old_logp``, ``sampler_logp``, ``mask`` ``[B, T]``; ``advantages``
    ``[B]`` (token-level losses also accept ``[B, T]``). ``hparams`` are the loss's
    keyword hyperparameters (:func:`policy_loss_defaults`); unknown names raise
    ``ValueError`` listing the valid ones. Returns ``(loss, metrics)``: a scalar whose
    gradient flows only through ``logp``, and a ``dict[str, float]`` (one host sync), or
    with ``on_device=True`` the same metrics as detached 0-d float64 tensors (no sync: a
    learner reads them once after all its micro-batches are queued).
    """
    fn = _lookup(loss_type)
    valid = policy_loss_defaults(loss_type)
    unknown = sorted(set(hparams) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown hyperparameter(s) {', '.join(unknown)} for loss {loss_type!r}; "
            f"valid: {', '.join(valid)}"
        )
    tensors = {"logp": logp, "old_logp": old_logp, "sampler_logp": sampler_logp, "mask": mask}
    _check_shapes(loss_type, tensors, advantages)
    loss, metrics = fn(logp, old_logp, sampler_logp, advantages, mask, **hparams)
    return loss, (metrics if on_device else floats(metrics))
