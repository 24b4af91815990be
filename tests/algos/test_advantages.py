"""Advantage estimators: hand values and GAE against a naive loop."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos import ADVANTAGE_ESTIMATORS, compute_advantages, compute_gae

F64 = torch.float64


def test_grpo_hand_values():
    # group 1: r = [1, 0, 0, 0], mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5
    #          -> (0.75 / 0.5, -0.25 / 0.5) = (1.5, -0.5) up to eps = 1e-6 in the denominator
    # group 2: r = [1, 1, 0, 0], mean 0.5, std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 3: all equal -> 0 (std 0, eps keeps it finite)
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], dtype=F64)
    adv = compute_advantages("grpo", rewards, 4)
    s2 = math.sqrt(1 / 3)
    expected = [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3
    expected += [0.5 / (s2 + 1e-6)] * 2 + [-0.5 / (s2 + 1e-6)] * 2 + [0.0] * 4
    assert torch.allclose(adv, torch.tensor(expected, dtype=F64), atol=1e-12)
    # a custom eps
    adv = compute_advantages("grpo", rewards[:4], 4, eps=0.5)
    assert math.isclose(adv[0].item(), 0.75 / 1.0)


def test_grpo_group_of_one_is_zero():
    assert torch.equal(compute_advantages("grpo", torch.tensor([3.0, -1.0]), 1), torch.zeros(2))


def test_dr_grpo_hand_values():
    # r - mean_group: [1, 0, 0, 0] -> [0.75, -0.25, -0.25, -0.25]; [2, 4] -> [-1, 1]
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 0, 0, 0]), 4)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(compute_advantages("dr_grpo", torch.tensor([2.0, 4.0]), 2), torch.tensor([-1.0, 1.0]))


def test_rloo_hand_values():
    # r_i - mean of the others: [1, 0, 0, 0] -> [1 - 0, 0 - 1/3, 0 - 1/3, 0 - 1/3]
    # [3, 1, 2] -> [3 - 1.5, 1 - 2.5, 2 - 2] = [1.5, -1.5, 0]  (= 3/2 * (r - 2))
    adv = compute_advantages("rloo", torch.tensor([1.0, 0, 0, 0, 3, 1, 2, 0]), 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    adv = compute_advantages("rloo", torch.tensor([3.0, 1.0, 2.0]), 3)
    assert torch.allclose(adv, torch.tensor([1.5, -1.5, 0.0]))


def test_integer_rewards_become_float():
    adv = compute_advantages("dr_grpo", torch.tensor([1, 0]), 2)
    assert adv.is_floating_point() and torch.allclose(adv, torch.tensor([0.5, -0.5]))


def test_errors():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="group_size 4 does not divide the number of rewards 6"):
        compute_advantages("grpo", r, 4)
    with pytest.raises(ValueError, match="valid: grpo, dr_grpo, rloo"):
        compute_advantages("ppo", r, 2)
    with pytest.raises(ValueError, match="compute_gae"):
        compute_advantages("gae", r, 2)
    with pytest.raises(ValueError, match="unknown option.*eps.*dr_grpo"):
        compute_advantages("dr_grpo", r, 2, eps=1e-6)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", r, 1)
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages("grpo", r.reshape(2, 3), 3)
    with pytest.raises(ValueError, match="positive int"):
        compute_advantages("grpo", r, 0)
    assert ADVANTAGE_ESTIMATORS == ("grpo", "dr_grpo", "rloo")


def test_gae_hand_values():
    # gamma = lam = 1, rewards [0, 1], values [0.5, 0.8]:
    # delta_1 = 1 - 0.8 = 0.2, delta_0 = 0 + 0.8 - 0.5 = 0.3 ; A = [0.3 + 0.2, 0.2] = [0.5, 0.2]
    # returns = A + V = [1.0, 1.0]
    adv, ret = compute_gae(
        torch.tensor([[0.0, 1.0]], dtype=F64), torch.tensor([[0.5, 0.8]], dtype=F64),
        torch.ones(1, 2, dtype=F64), gamma=1.0, lam=1.0,
    )
    assert torch.allclose(adv, torch.tensor([[0.5, 0.2]], dtype=F64))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0]], dtype=F64))


def naive_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(values)
    for i in range(values.shape[0]):
        idx = [j for j in range(values.shape[1]) if mask[i, j] > 0]
        running, next_v = 0.0, 0.0
        for j in reversed(idx):
            delta = float(rewards[i, j]) + gamma * next_v - float(values[i, j])
            running = delta + gamma * lam * running
            adv[i, j] = running
            next_v = float(values[i, j])
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_naive_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    batch, seq_len = 5, 8
    rewards = torch.randn(batch, seq_len, generator=gen, dtype=F64)
    values = torch.randn(batch, seq_len, generator=gen, dtype=F64)
    mask = torch.zeros(batch, seq_len, dtype=F64)
    for i, n in enumerate([1, 8, 3, 0, 6]):
        mask[i, :n] = 1
    mask[4, 2] = 0  # a hole inside a response (e.g. a tool output) is skipped, not a step
    values_padded = values.masked_fill(mask == 0, float("nan"))  # padding never read
    adv, ret = compute_gae(rewards, values_padded, mask, gamma, lam)
    exp_adv, exp_ret = naive_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, exp_adv, atol=1e-12)
    assert torch.allclose(ret, exp_ret, atol=1e-12)
    assert not adv.requires_grad


def test_last_token_rewards_by_hand():
    from quarl.algos.advantages import last_token_rewards

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = last_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


def test_whiten_by_hand():
    from quarl.algos.advantages import whiten

    # masked values 1, 2, 3: mean 2, unbiased std 1 -> -1, 0, 1; the unmasked 100 becomes 0
    v = torch.tensor([[1.0, 100.0], [2.0, 3.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert torch.allclose(whiten(v, m, eps=0.0), torch.tensor([[-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64))
    one = whiten(torch.tensor([[4.0, 7.0]]), torch.tensor([[0.0, 1.0]]), eps=0.0)  # one entry: std taken as 1
    assert torch.equal(one, torch.tensor([[0.0, 0.0]]))
    assert torch.equal(whiten(v, torch.zeros(2, 2)), torch.zeros(2, 2, dtype=torch.float64))

