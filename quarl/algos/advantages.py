"""Advantage estimators.

Outcome-reward estimators work on ``rewards [N]`` laid out as consecutive groups of
``group_size`` responses to the same prompt (``N = num_prompts * group_size``) and give
one advantage per response (broadcast to its tokens by the losses):

- ``grpo``    ``(r - mean_group) / (std_group + eps)``, unbiased std, eps 1e-6
              (Shao et al. 2024, DeepSeekMath eq. 3 outcome supervision).
- ``dr_grpo`` ``r - mean_group`` (Liu et al. 2025, "Dr. GRPO": no std division).
- ``rloo``    ``r - mean of the other group_size - 1 rewards`` (Ahmadian et al. 2024),
              which equals ``group_size / (group_size - 1) * (r - mean_group)``.

:func:`compute_gae` is the token-level estimator for PPO with a critic.
"""

from __future__ import annotations

from typing import Callable

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N] -> [N / group_size, group_size]`` with a clear error on a bad layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the number of rewards {rewards.numel()}: "
            "rewards must hold consecutive groups of group_size responses per prompt"
        )
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return rewards.to(dtype).reshape(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; ``[N] -> [N]``.

    std is the unbiased (n - 1) estimate; a group of one response gets advantage 0.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if group_size == 1:
        return centred.reshape(-1)
    std = groups.std(dim=1, keepdim=True)
    return (centred / (std + eps)).reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: ``r - mean_group``; ``[N] -> [N]``."""
    groups = _grouped(rewards, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - (sum_group - r_i) / (group_size - 1)``; ``[N] -> [N]``."""
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    groups = _grouped(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


ADVANTAGE_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(ADVANTAGE_FNS)
_ESTIMATOR_KWARGS: dict[str, tuple[str, ...]] = {"grpo": ("eps",), "dr_grpo": (), "rloo": ()}


def compute_advantages(estimator: str, rewards: torch.Tensor, group_size: int, **kw) -> torch.Tensor:
    """Per-response advantages ``[N]`` from outcome ``rewards [N]`` (module docstring).

    ``estimator`` is one of :data:`ADVANTAGE_ESTIMATORS`; ``kw`` its options (``grpo``:
    ``eps``). Unknown estimators or options raise ``ValueError`` listing the valid ones.
    """
    if estimator not in ADVANTAGE_FNS:
        hint = " (use compute_gae for PPO with a critic)" if estimator == "gae" else ""
        raise ValueError(
            f"unknown advantage estimator {estimator!r}{hint}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    unknown = sorted(set(kw) - set(_ESTIMATOR_KWARGS[estimator]))
    if unknown:
        valid = ", ".join(_ESTIMATOR_KWARGS[estimator]) or "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {estimator!r}; valid: {valid}")
    return ADVANTAGE_FNS[estimator](rewards, group_size, **kw)


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over response tokens.

    ``token_rewards``, ``values``, ``mask``: ``[B, T]`` (mask 1.0 on response tokens).
    Positions off the mask are skipped, not treated as steps: the recursion
    ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next`` links each
    response token to the next response token of its row, and the value after the last
    one is 0 (the episode ends). Returns ``(advantages, returns)``, both ``[B, T]``,
    detached, 0 off the mask; ``returns = advantages + values`` (the critic's target).
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            "token_rewards, values and mask must all be [B, T]; got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    with torch.no_grad():
        m = mask.to(values.dtype)
        rewards = torch.where(m > 0, token_rewards.to(values.dtype), 0.0)
        vals = torch.where(m > 0, values, 0.0)
        next_value = torch.zeros_like(vals[:, 0])
        next_adv = torch.zeros_like(vals[:, 0])
        advantages = torch.zeros_like(vals)
        for t in reversed(range(vals.shape[1])):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            adv_t = delta + gamma * lam * next_adv
            on = m[:, t] > 0
            advantages[:, t] = torch.where(on, adv_t, 0.0)
            next_value = torch.where(on, vals[:, t], next_value)
            next_adv = torch.where(on, adv_t, next_adv)
        returns = torch.where(m > 0, advantages + vals, 0.0)
    return advantages, returns


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` token rewards: each response's outcome ``rewards [B]`` on its last masked
    token, 0 elsewhere (the input of :func:`compute_gae` for outcome rewards)."""
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    return torch.where(last, rewards[:, None].to(mask.dtype), torch.zeros_like(mask))


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / (std + eps)`` over the masked entries (unbiased std), 0 off the
    mask, as PPO implementations normalise GAE advantages over a batch. With fewer than
    two masked entries the std is taken as 1."""
    m = mask > 0
    if not m.any():
        return torch.zeros_like(values)
    picked = values[m]
    sd = picked.std() if picked.numel() > 1 else torch.ones((), dtype=values.dtype, device=values.device)
    return torch.where(m, (values - picked.mean()) / (sd + eps), torch.zeros_like(values))

