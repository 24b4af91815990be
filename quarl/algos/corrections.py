"""Importance corrections for the sampler/learner mismatch.

The rollout engine samples from ``pi_sampler`` (low-bit weights and kernels) while the
policy-gradient estimator needs ``pi_old`` (the learner at the start of the step, the
"proximal" policy of decoupled PPO). The token mismatch weight is

    w = pi_old / pi_sampler = exp(old_logp - sampler_logp)        (always detached)

A correction is three separate choices (:class:`CorrectionSpec`), each a pure function below:

importance weights (:func:`importance_weights`), at one level, truncated to ``[low, high]``
    ``token``      ``clamp(w_t, low, high)``
    ``sequence``   ``clamp(prod_t w_t, low, high)``, one weight per response
    ``geometric``  ``clamp(exp(mean_t log w_t), low, high)``, one weight per response
rejection (:func:`rejection_keep`), at one level, keeping what lies in ``[low, high]``
    ``token``      tokens whose ``w_t`` leaves the band are removed
    ``sequence``   responses whose ``prod_t w_t`` leaves it are removed
    ``geometric``  responses whose ``exp(mean_t log w_t)`` leaves it are removed
veto (:func:`veto_keep`)
    a response with any token whose ``w_t`` lies outside ``[veto, 1 / veto]`` is removed.

Removed tokens leave the loss: they add nothing and leave its denominator (the token count
of ``token-mean``; a response with no token left leaves the response count of the sequence
means). Sequence statistics are taken over the response's tokens before any removal.

The named corrections are presets of these choices (``C`` = ``cap``):

token level (``ppo``, ``positive_only``, ``sapo``)
    ``none``       nothing
    ``tis``        token weights in ``[0, C]``          FlashRL / QuRL eq. 5
    ``decoupled``  token weights, untruncated           Hilton et al. 2022 / QuRL eq. 4
    ``acr``        ``tis``, and the PPO upper clip bound becomes (1 + eps_high) / rho with
                   rho = min(1, C / w)                  QuRL eq. 9 (adaptive clipping range)
    ``icepop``     untruncated token weights, token rejection outside ``[1/C, C]`` (IcePop)
sequence level (``gspo``, ``tbpo``; ``tbpo`` defaults to ``seq-tis``)
    ``seq-tis``    geometric weights in ``[1/C, C]``    QaRL eq. 5 (two-sided truncation)
    ``mis``        untruncated geometric weights, geometric rejection outside ``[1/C, C]``

When sampler and learner agree (``old_logp == sampler_logp``) every weight is exactly 1,
nothing is removed and every ACR bound equals the plain PPO bound.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from quarl.algos.aggregation import _masked, masked_sum, seq_mean

LEVELS: tuple[str, ...] = ("none", "token", "sequence", "geometric")
TOKEN_CORRECTIONS: tuple[str, ...] = ("none", "tis", "decoupled", "acr", "icepop")
SEQ_CORRECTIONS: tuple[str, ...] = ("none", "seq-tis", "mis")
PRESETS: tuple[str, ...] = tuple(dict.fromkeys(TOKEN_CORRECTIONS + SEQ_CORRECTIONS))

# log-weights are clamped to +-20 before exp (a sequence product can reach any size)
_MAX_LOG = 20.0


class CorrectionSpec(NamedTuple):
    """What a correction does (module docstring). ``adaptive_clip``: ACR's upper clip bound
    ``(1 + eps_high) * max(1, w / weight_high)`` (token weights only)."""

    weights: str = "none"
    weight_low: float = 0.0
    weight_high: float = math.inf
    reject: str = "none"
    reject_low: float = 0.5
    reject_high: float = 2.0
    veto: float | None = None
    adaptive_clip: bool = False

    @property
    def rejects(self) -> bool:
        """Whether the correction removes tokens or responses."""
        return self.reject != "none" or self.veto is not None

    def without_rejection(self) -> "CorrectionSpec":
        """The same weights, nothing removed (for a batch whose mask already removed it)."""
        return self._replace(reject="none", veto=None)


class Correction(NamedTuple):
    """``weight [B, T]`` multiplies the per-token loss (for the sequence levels constant
    along a row); ``row_weight [B]`` is that row's weight (all ones at the token level);
    ``upper_scale [B, T]`` multiplies the PPO upper clip bound (1 except under ACR);
    ``keep [B, T]`` (bool) the response tokens left after rejection and veto."""

    weight: torch.Tensor
    row_weight: torch.Tensor
    upper_scale: torch.Tensor
    keep: torch.Tensor


def check_cap(cap: float) -> None:
    if not cap >= 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")


def _check_level(what: str, level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown {what} level {level!r}; valid: {', '.join(LEVELS)}")


def _check_band(what: str, low: float, high: float) -> None:
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"{what} bounds must satisfy 0 <= low <= 1 <= high; got low={low}, high={high}")


def preset(name: str, cap: float = 2.0) -> CorrectionSpec:
    """The :class:`CorrectionSpec` of a named correction (module docstring) at ``cap``."""
    check_cap(cap)
    specs = {
        "none": CorrectionSpec(),
        "tis": CorrectionSpec("token", 0.0, cap),
        "decoupled": CorrectionSpec("token"),
        "acr": CorrectionSpec("token", 0.0, cap, adaptive_clip=True),
        "icepop": CorrectionSpec("token", reject="token", reject_low=1.0 / cap, reject_high=cap),
        "seq-tis": CorrectionSpec("geometric", 1.0 / cap, cap),
        "mis": CorrectionSpec("geometric", reject="geometric", reject_low=1.0 / cap, reject_high=cap),
    }
    if name not in specs:
        raise ValueError(f"unknown correction {name!r}; valid: {', '.join(PRESETS)}")
    return specs[name]


def build_spec(
    correction: str = "none",
    cap: float = 2.0,
    *,
    weights: str | None = None,
    weight_low: float | None = None,
    weight_high: float | None = None,
    reject: str | None = None,
    reject_low: float | None = None,
    reject_high: float | None = None,
    veto: float | None = None,
) -> CorrectionSpec:
    """A preset with explicit choices on top: ``weights`` replaces the preset's weights (only
    with a preset that has none: ``none``) and ``weight_low`` / ``weight_high`` bound whichever
    weights there are (defaults ``0`` / ``cap`` for explicit weights); ``reject`` adds a
    rejection (defaults ``1/reject_high`` / ``cap``; not with ``icepop`` / ``mis``, which
    reject already); ``veto`` adds the veto. Raises ``ValueError`` naming a conflict."""
    spec = preset(correction, cap)
    if weights is not None and weights != "none":
        _check_level("weights", weights)
        if spec.weights != "none":
            raise ValueError(f"correction {correction!r} has its own {spec.weights} weights; with explicit "
                             f"weights={weights!r} use correction 'none'")
        spec = spec._replace(weights=weights, weight_low=0.0, weight_high=cap)
    if weight_low is not None or weight_high is not None:
        if spec.weights == "none":
            raise ValueError("weight_low / weight_high bound importance weights, and this correction has none: "
                             "set weights (token, sequence or geometric) or a weighted correction")
        spec = spec._replace(weight_low=spec.weight_low if weight_low is None else weight_low,
                             weight_high=spec.weight_high if weight_high is None else weight_high)
    if reject is not None and reject != "none":
        _check_level("reject", reject)
        if spec.reject != "none":
            raise ValueError(f"correction {correction!r} already rejects at the {spec.reject} level; with "
                             f"reject={reject!r} use a correction without rejection (e.g. decoupled for icepop's "
                             "weights)")
        high = cap if reject_high is None else reject_high
        spec = spec._replace(reject=reject, reject_high=high,
                             reject_low=1.0 / high if reject_low is None else reject_low)
    elif reject_low is not None or reject_high is not None:
        if spec.reject == "none":
            raise ValueError("reject_low / reject_high bound a rejection, and none is set: set reject "
                             "(token, sequence or geometric)")
        spec = spec._replace(reject_low=spec.reject_low if reject_low is None else reject_low,
                             reject_high=spec.reject_high if reject_high is None else reject_high)
    if veto is not None:
        if not 0.0 < veto < 1.0:
            raise ValueError(f"veto must lie in (0, 1) (a token ratio below veto or above 1/veto vetoes its "
                             f"response; e.g. 1e-4), got {veto}")
        spec = spec._replace(veto=veto)
    check_spec(spec)
    return spec


def check_spec(spec: CorrectionSpec) -> None:
    _check_level("weights", spec.weights)
    _check_level("reject", spec.reject)
    _check_band("weight", spec.weight_low, spec.weight_high)
    _check_band("reject", spec.reject_low, spec.reject_high)
    if spec.adaptive_clip and spec.weights != "token":
        raise ValueError("the adaptive clip (acr) needs token weights")


def mismatch_log_weight(
    old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``log w = old_logp - sampler_logp`` ``[B, T]``, detached, exactly 0 off the mask."""
    return _masked((old_logp - sampler_logp).detach(), mask)


def row_log_weight(level: str, log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per response ``[B]``: ``sum_t log w`` (``sequence``) or ``mean_t log w`` (``geometric``)."""
    if level == "sequence":
        return masked_sum(log_w, mask, dim=-1)
    if level == "geometric":
        return seq_mean(log_w, mask)
    raise ValueError(f"row_log_weight takes the sequence or geometric level, got {level!r}")


def _in_band(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    lo = -math.inf if low == 0.0 else math.log(low)
    return (log_x >= lo) & (log_x <= math.log(high))


def _bounded_exp(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    lo = -_MAX_LOG if low == 0.0 else max(math.log(low), -_MAX_LOG)
    hi = _MAX_LOG if math.isinf(high) else min(math.log(high), _MAX_LOG)
    return torch.exp(log_x.clamp(lo, hi))


def importance_weights(
    level: str, log_w: torch.Tensor, mask: torch.Tensor, low: float = 0.0, high: float = math.inf
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [B, T], row_weight [B])`` at ``level`` truncated to ``[low, high]`` (module
    docstring); ``log_w`` from :func:`mismatch_log_weight`. Token level: ``row_weight`` is 1."""
    _check_level("weights", level)
    _check_band("weight", low, high)
    batch = log_w.shape[0]
    if level == "none":
        return torch.ones_like(log_w), log_w.new_ones(batch)
    if level == "token":
        return _masked(_bounded_exp(log_w, low, high), mask) + (1.0 - mask.to(log_w.dtype)), log_w.new_ones(batch)
    row = _bounded_exp(row_log_weight(level, log_w, mask), low, high)
    return row[:, None].expand_as(log_w), row


def rejection_keep(
    level: str, log_w: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 2.0
) -> torch.Tensor:
    """``[B, T]`` bool: the response tokens that a rejection at ``level`` keeps (those whose
    token, product or geometric-mean ratio lies in ``[low, high]``, bounds included)."""
    _check_level("reject", level)
    _check_band("reject", low, high)
    on = mask.bool()
    if level == "none":
        return on
    if level == "token":
        return on & _in_band(log_w, low, high)
    return on & _in_band(row_log_weight(level, log_w, mask), low, high)[:, None]


def veto_keep(log_w: torch.Tensor, mask: torch.Tensor, veto: float) -> torch.Tensor:
    """``[B]`` bool: responses none of whose tokens has ``w`` outside ``[veto, 1 / veto]``."""
    if not 0.0 < veto < 1.0:
        raise ValueError(f"veto must lie in (0, 1), got {veto}")
    extreme = log_w.abs() > -math.log(veto)
    return ~(extreme & mask.bool()).any(-1)


def mismatch_correction(
    spec: CorrectionSpec, old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor
) -> Correction:
    """The weights, ACR bound scale and kept tokens of ``spec`` (``[B, T]`` inputs; detached)."""
    check_spec(spec)
    log_w = mismatch_log_weight(old_logp, sampler_logp, mask)
    weight, row_weight = importance_weights(spec.weights, log_w, mask, spec.weight_low, spec.weight_high)
    upper = torch.ones_like(log_w)
    if spec.adaptive_clip:
        # (1 + eps_high) / rho with rho = min(1, C / w)  ==  (1 + eps_high) * max(1, w / C)
        upper = (torch.exp(log_w.clamp(max=_MAX_LOG)) / spec.weight_high).clamp(min=1.0)
    keep = rejection_keep(spec.reject, log_w, mask, spec.reject_low, spec.reject_high)
    if spec.veto is not None:
        keep = keep & veto_keep(log_w, mask, spec.veto)[:, None]
    return Correction(weight, row_weight, upper, keep)
