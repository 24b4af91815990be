"""Policy losses: hand-computed values, gradients against a naive per-token loop, invariants."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos import AGG_MODES, POLICY_LOSSES, compute_policy_loss, policy_loss_defaults
from quarl.algos.corrections import CorrectionSpec, build_spec, preset

F64 = torch.float64
COMMON_METRICS = {
    "loss/policy",
    "loss/clip_frac",
    "loss/ratio_mean",
    "loss/ratio_max",
    "correction/w_mean",
    "correction/w_max",
    "correction/drop_frac",
}


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def logs(rows) -> torch.Tensor:
    return torch.log(t(rows))


def run(loss_type, *, ratio, adv, w=None, mask=None, old=None, **hp):
    """Loss and grad w.r.t. logp for given token ratios R and mismatch weights w.

    logp = old + log R, sampler = old - log w.
    """
    ratio = t(ratio)
    old = torch.full_like(ratio, -1.0) if old is None else old
    w = torch.ones_like(ratio) if w is None else t(w)
    logp = (old + torch.log(ratio)).requires_grad_()
    mask = torch.ones_like(ratio) if mask is None else t(mask)
    loss, metrics = compute_policy_loss(
        loss_type,
        logp=logp,
        old_logp=old,
        sampler_logp=old - torch.log(w),
        advantages=t(adv),
        mask=mask,
        **hp,
    )
    loss.backward()
    return loss.item(), logp.grad, metrics


def close(a, b, tol=1e-12):
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=0)


# ---------------------------------------------------------------- hand-computed values


def test_ppo_hand_values_token_mean():
    # A = +1 row:  R=1.1 -> -1.1 ; R=1.5 -> clipped at 1.2 -> -1.2 (cut) ; R=0.5 -> -0.5
    # A = -1 row:  R=1.1 -> 1.1  ; R=1.5 -> 1.5 (no upper clip for A<0) ; R=0.5 -> 0.8 (cut)
    # token-mean = (-1.1 - 1.2 - 0.5 + 1.1 + 1.5 + 0.8) / 6 = 0.6 / 6 = 0.1 ; clip_frac 2/6
    # d/dlogp = dloss/dR * R / 6 : [-1.1, 0, -0.5] / 6 and [1.1, 1.5, 0] / 6
    loss, grad, m = run("ppo", ratio=[[1.1, 1.5, 0.5], [1.1, 1.5, 0.5]], adv=[1.0, -1.0])
    assert math.isclose(loss, 0.1, abs_tol=1e-12)
    assert close(grad, t([[-1.1, 0.0, -0.5], [1.1, 1.5, 0.0]]) / 6)
    assert math.isclose(m["loss/clip_frac"], 2 / 6)
    assert m["loss/policy"] == loss
    assert m["correction/w_mean"] == 1.0 and m["correction/w_max"] == 1.0
    assert math.isclose(m["loss/ratio_max"], 1.5) and math.isclose(m["loss/ratio_mean"], 3.1 / 3)


def test_ppo_clip_higher_dapo():
    # eps_high 0.28: A=+1, R=1.25 no longer clipped -> -1.25, grad -1.25 ; R=1.3 -> -1.28, cut
    loss, grad, m = run("ppo", ratio=[[1.25, 1.3]], adv=[1.0], eps_high=0.28)
    assert math.isclose(loss, (-1.25 - 1.28) / 2, abs_tol=1e-12)
    assert close(grad, t([[-1.25, 0.0]]) / 2)
    assert m["loss/clip_frac"] == 0.5


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, c = 3: R=5 -> max(5, 1.2) = 5, capped at -c A = 3, gradient cut ;
    # R=2 -> 2 < 3 unchanged, grad dloss/dR * R = 2 ; token-mean over 2 tokens.
    loss, grad, m = run("ppo", ratio=[[5.0, 2.0]], adv=[-1.0], dual_clip_c=3.0)
    assert math.isclose(loss, (3.0 + 2.0) / 2, abs_tol=1e-12)
    assert close(grad, t([[0.0, 2.0 / 2]]))
    assert m["loss/clip_frac"] == 0.5
    # with A = -2 the cap is -c A = 6: R=5 -> 10 capped at 6
    loss, _, _ = run("ppo", ratio=[[5.0]], adv=[-2.0], dual_clip_c=3.0)
    assert math.isclose(loss, 6.0, abs_tol=1e-12)
    # positive advantages are untouched by the dual clip
    loss_dc, grad_dc, _ = run("ppo", ratio=[[1.1, 5.0]], adv=[1.0], dual_clip_c=3.0)
    loss_pl, grad_pl, _ = run("ppo", ratio=[[1.1, 5.0]], adv=[1.0])
    assert loss_dc == loss_pl and torch.equal(grad_dc, grad_pl)


def test_tis_and_decoupled_weights():
    # w = [3, 0.5], cap 2, A = +1, R = 1.1 (unclipped):
    # tis:       min(w, 2) = [2, 0.5] -> (-2.2 - 0.55) / 2 = -1.375, grads [-2.2, -0.55] / 2
    # decoupled: w = [3, 0.5]        -> (-3.3 - 0.55) / 2 = -1.925
    loss, grad, m = run("ppo", ratio=[[1.1, 1.1]], adv=[1.0], w=[[3.0, 0.5]], correction="tis")
    assert math.isclose(loss, -1.375, abs_tol=1e-12)
    assert close(grad, t([[-2.2, -0.55]]) / 2)
    assert math.isclose(m["correction/w_mean"], 1.25) and math.isclose(m["correction/w_max"], 2.0)
    loss, _, m = run("ppo", ratio=[[1.1, 1.1]], adv=[1.0], w=[[3.0, 0.5]], correction="decoupled")
    assert math.isclose(loss, -1.925, abs_tol=1e-12)
    assert math.isclose(m["correction/w_max"], 3.0)


def test_acr_widens_upper_clip_by_cap_over_w():
    # w = 4 > cap = 2: rho = min(1, 2/4) = 0.5, upper bound (1 + 0.2) / 0.5 = 2.4, weight min(4, 2) = 2.
    # A = +1: R=2.0 -> unclipped under ACR: 2 * -2.0 = -4.0, grad -4.0
    #         (TIS clips at 1.2: 2 * -1.2 = -2.4, grad 0)
    #         R=2.39 just inside 2.4 -> grad 2 * -2.39 ; R=2.41 just outside -> clipped at 2.4, grad 0
    ratio, w = [[2.0, 2.39, 2.41]], [[4.0, 4.0, 4.0]]
    loss, grad, m = run("ppo", ratio=ratio, adv=[1.0], w=w, correction="acr")
    assert math.isclose(loss, 2 * (-2.0 - 2.39 - 2.4) / 3, abs_tol=1e-12)
    assert close(grad, t([[-4.0, -4.78, 0.0]]) / 3)
    assert math.isclose(m["loss/clip_frac"], 1 / 3)
    loss, grad, m = run("ppo", ratio=ratio, adv=[1.0], w=w, correction="tis")
    assert math.isclose(loss, 2 * (-1.2 * 3) / 3, abs_tol=1e-12)
    assert close(grad, torch.zeros(1, 3, dtype=F64))
    assert m["loss/clip_frac"] == 1.0


def test_acr_equals_tis_when_w_within_cap():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=gen, dtype=F64) * 3
    ratio = torch.exp(torch.randn(4, 6, generator=gen, dtype=F64) * 0.4)
    w = torch.exp(torch.empty(4, 6, dtype=F64).uniform_(-1.5, math.log(2.0), generator=gen))  # w <= cap
    adv = torch.randn(4, generator=gen, dtype=F64)
    out = {
        c: run("ppo", ratio=ratio.tolist(), adv=adv.tolist(), w=w.tolist(), old=old, correction=c)
        for c in ("acr", "tis")
    }
    assert out["acr"][0] == out["tis"][0]
    assert torch.equal(out["acr"][1], out["tis"][1])
    assert out["acr"][2] == out["tis"][2]


def test_icepop_removes_out_of_band_tokens_from_the_loss_and_its_denominator():
    # cap 2, band [0.5, 2]: w = [0.4, e^0.3, 2.5] -> only the middle token stays, weighted by w
    # A = +1, R = 1: token-mean over the one kept token -e^0.3, grads [0, -e^0.3, 0]
    e = math.exp(0.3)
    loss, grad, m = run("ppo", ratio=[[1.0, 1.0, 1.0]], adv=[1.0], w=[[0.4, e, 2.5]], correction="icepop")
    assert math.isclose(loss, -e, abs_tol=1e-12)
    assert close(grad, t([[0.0, -e, 0.0]]))
    assert math.isclose(m["correction/drop_frac"], 2 / 3)
    assert math.isclose(m["correction/w_max"], e) and math.isclose(m["correction/w_mean"], e)
    # a second row with every token in band: token-mean over 1 + 2 kept tokens = (-e - 2) / 3
    loss, grad, _ = run("ppo", ratio=[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], adv=[1.0, 1.0],
                        w=[[0.4, e, 2.5], [1.0, 1.0, 1.0]], mask=[[1, 1, 1], [1, 1, 0]], correction="icepop")
    assert math.isclose(loss, (-e - 2.0) / 3, abs_tol=1e-12)
    assert close(grad, t([[0.0, -e, 0.0], [-1.0, -1.0, 0.0]]) / 3)


def test_token_rejection_geometric_rejection_and_veto_in_a_token_loss():
    # ppo, A = +1, R = 1, tis weights (cap 2). rows of w:
    #  0: (1, 3.9)     geometric mean 1.975 -> kept by geometric rejection in [0.5, 2]; tis weights (1, 2)
    #  1: (9, 1)       geometric mean 3 -> removed
    #  2: (1, 1e-5)    geometric mean 0.00316 -> removed (and vetoed at 1e-4)
    # token-mean over row 0's 2 tokens: -(1 + 2) / 2; seq-mean-token-mean over the 1 row left: the same
    w = [[1.0, 3.9], [9.0, 1.0], [1.0, 1e-5]]
    kw = dict(ratio=[[1.0, 1.0]] * 3, adv=[1.0, 1.0, 1.0], w=w)
    spec = build_spec("tis", 2.0, reject="geometric")
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, grad, m = run("ppo", correction=spec, agg=agg, **kw)
        assert math.isclose(loss, -1.5, abs_tol=1e-12)
        assert close(grad, t([[-0.5, -1.0], [0.0, 0.0], [0.0, 0.0]]))
        assert math.isclose(m["correction/drop_frac"], 4 / 6)
    # veto alone (1e-4): only row 2 leaves; token-mean over 4 tokens of tis weights (1, 2, 2, 1)
    loss, grad, m = run("ppo", correction=build_spec("tis", 2.0, veto=1e-4), **kw)
    assert math.isclose(loss, -6.0 / 4, abs_tol=1e-12)
    assert close(grad, t([[-1.0, -2.0], [-2.0, -1.0], [0.0, 0.0]]) / 4)
    # sequence-level weights for a token loss: products (3.9 -> 3, 9 -> 3, 1e-5 -> 0.5) in [0.5, 3]
    loss, grad, _ = run("ppo", correction=build_spec("none", 3.0, weights="sequence", weight_low=0.5), **kw)
    assert math.isclose(loss, -(2 * 3 + 2 * 3 + 2 * 0.5) / 6, abs_tol=1e-12)
    assert close(grad, t([[-3.0, -3.0], [-3.0, -3.0], [-0.5, -0.5]]) / 6)


def test_positive_only_masks_negative_responses():
    # rows A = [+1, -1], R = 1.1: the A<0 row leaves the token-mean -> loss -1.1, its grad 0
    loss, grad, m = run("positive_only", ratio=[[1.1], [1.1]], adv=[1.0, -1.0])
    assert math.isclose(loss, -1.1, abs_tol=1e-12)
    assert close(grad, t([[-1.1], [0.0]]))
    assert m["positive_only/drop_frac"] == 0.5
    # under seq-mean-token-mean the dropped row leaves the row count too: -1.1 / 1
    loss, _, _ = run("positive_only", ratio=[[1.1], [1.1]], adv=[1.0, -1.0], agg="seq-mean-token-mean")
    assert math.isclose(loss, -1.1, abs_tol=1e-12)


def test_sapo_hand_values():
    # A=+1, R=1.5, tau_pos=1:    -(4/1) sigmoid(0.5) = -4 * 0.6224593 = -2.4898373
    #                            grad = -4 s (1-s) R A = -4 * 0.6224593 * 0.3775407 * 1.5 = -1.4099
    # A=-1, R=1.5, tau_neg=1.05: +(4/1.05) sigmoid(0.525) = 3.8095238 * 0.6283124 = 2.3935711
    #                            grad = +4 s (1-s) R with s = sigmoid(0.525)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    s1, s2 = sig(0.5), sig(1.05 * 0.5)
    loss, grad, m = run("sapo", ratio=[[1.5], [1.5]], adv=[1.0, -1.0])
    assert math.isclose(loss, (-4 * s1 + 4 / 1.05 * s2) / 2, abs_tol=1e-12)
    assert close(grad, t([[-4 * s1 * (1 - s1) * 1.5], [4 * s2 * (1 - s2) * 1.5]]) / 2)
    assert m["loss/clip_frac"] == 0.0
    # at R = 1 the gate gives exactly the policy gradient -A (times the tis weight min(3, 2) = 2)
    loss, grad, _ = run("sapo", ratio=[[1.0]], adv=[0.7], w=[[3.0]], correction="tis")
    assert math.isclose(loss, -2 * 2 * 0.7, abs_tol=1e-12)
    assert close(grad, t([[-2 * 0.7]]))


def test_gspo_hand_values():
    # eps 0.2/0.2, B = 3 rows of 2 tokens, s = exp(mean log R) = geometric mean of R:
    # row 0: A=+1, R=(1.1, 1.5): s = sqrt(1.65) = 1.2845 -> clipped at 1.2 -> -1.2 (cut)
    # row 1: A=+1, R=(1.1, 1.1): s = 1.1 -> -1.1, d/dlogp_t = -s / L / B = -1.1 / 2 / 3
    # row 2: A=-1, R=(1.5, 1.5): s = 1.5 -> +1.5 (no upper clip for A<0), grad +1.5 / 2 / 3
    # loss = (-1.2 - 1.1 + 1.5) / 3 = -0.8 / 3
    ratio = [[1.1, 1.5], [1.1, 1.1], [1.5, 1.5]]
    loss, grad, m = run("gspo", ratio=ratio, adv=[1.0, 1.0, -1.0], eps_low=0.2, eps_high=0.2)
    assert math.isclose(loss, -0.8 / 3, abs_tol=1e-12)
    assert close(grad, t([[0.0, 0.0], [-1.1, -1.1], [1.5, 1.5]]) / 6)
    assert math.isclose(m["loss/clip_frac"], 1 / 3)


def test_gspo_seq_tis_and_mis():
    # per-row mean_t(old - sampler): row 0 log 3 (w = 3 on both tokens), row 1 log 0.8
    # seq-tis: v = exp(clamp(., -log 2, log 2)) = [2, 0.8]; mis: v = [3 -> removed, 0.8]
    # R = 1, A = [+1, +1]: seq-tis loss = -(2 + 0.8) / 2 = -1.4 ; mis loss = -0.8 / 1 (the removed
    # response leaves N)
    kw = dict(ratio=[[1.0, 1.0], [1.0, 1.0]], adv=[1.0, 1.0], w=[[3.0, 3.0], [0.8, 0.8]])
    loss, grad, m = run("gspo", correction="seq-tis", **kw)
    assert math.isclose(loss, -1.4, abs_tol=1e-12)
    assert close(grad, t([[-2.0, -2.0], [-0.8, -0.8]]) / 2 / 2)
    assert math.isclose(m["correction/w_max"], 2.0) and math.isclose(m["correction/w_mean"], 1.4)
    loss, grad, m = run("gspo", correction="mis", **kw)
    assert math.isclose(loss, -0.8, abs_tol=1e-12)
    assert close(grad, t([[0.0, 0.0], [-0.8, -0.8]]) / 2)
    assert m["correction/drop_frac"] == 0.5


def test_tbpo_with_asymmetric_weight_bounds_and_token_rejection():
    # one token per row, r = R = 1, A = +1; w = (3, 0.6, 1.1, 1e-3)
    # weights geometric in [0.8, 1.25]: (1.25, 0.8, 1.1, .); token rejection in [0.5, 2] removes rows 0, 3
    # loss = -(0.8 + 1.1) / 2 (N = the 2 rows left)
    spec = build_spec("seq-tis", 2.0, weight_low=0.8, weight_high=1.25, reject="token")
    loss, grad, m = run("tbpo", ratio=[[1.0]] * 4, adv=[1.0] * 4, w=[[3.0], [0.6], [1.1], [1e-3]], correction=spec)
    assert math.isclose(loss, -1.9 / 2, abs_tol=1e-12)
    assert close(grad, t([[0.0], [-0.8], [-1.1], [0.0]]) / 2)
    assert m["correction/drop_frac"] == 0.5 and m["tbpo/drop_frac_pos"] == 0.0


def test_tbpo_trust_band():
    # defaults eps_high 4e-4, band for A<0 [1 - 3e-4, 1 + 7e-4], cap 2; one token per row so r = R.
    # row  A    r        v     band             kept   contribution -v r A
    #  0  +1  1.0003    1.5   r <= 1.0004       yes    -1.5 * 1.0003
    #  1  +1  1.0005    1      r > 1.0004        no     0
    #  2  -1  1.0005    2 (5 clamped to 2) in band yes  +2 * 1.0005
    #  3  -1  1.0008    1     > 1.0007          no     0   (negative response outside the band)
    #  4  -1  0.9996    1     < 0.9997          no     0
    #  5  -1  0.9998    1     in band           yes    +0.9998
    # loss = (-1.50045 + 2.001 + 0.9998) / 6 ; grads of kept rows = -v r A / 6, dropped rows 0
    ratio = [[1.0003], [1.0005], [1.0005], [1.0008], [0.9996], [0.9998]]
    w = [[1.5], [1.0], [5.0], [1.0], [1.0], [1.0]]
    loss, grad, m = run("tbpo", ratio=ratio, adv=[1, 1, -1, -1, -1, -1], w=w)
    assert math.isclose(loss, (-1.5 * 1.0003 + 2 * 1.0005 + 0.9998) / 6, abs_tol=1e-12)
    expected = t([[-1.5 * 1.0003], [0.0], [2 * 1.0005], [0.0], [0.0], [0.9998]]) / 6
    assert close(grad, expected)
    assert grad[3, 0] == 0.0 and grad[4, 0] == 0.0
    assert m["tbpo/drop_frac_pos"] == 0.5 and m["tbpo/drop_frac_neg"] == 0.5
    assert m["loss/clip_frac"] == 0.5
    assert math.isclose(m["correction/w_max"], 2.0)


def test_tbpo_sequence_ratio_is_geometric_mean():
    # two tokens R = (1.0010, 0.9994): r = sqrt(1.0010 * 0.9994) = 1.000199952 -> inside both bands;
    # grad per token = -v A r / L / B = -r / 2 for A = +1, B = 1
    loss, grad, _ = run("tbpo", ratio=[[1.0010, 0.9994]], adv=[1.0])
    r = math.sqrt(1.0010 * 0.9994)
    assert math.isclose(loss, -r, abs_tol=1e-12)
    assert close(grad, t([[-r / 2, -r / 2]]))


def test_seq_mean_token_sum_norm_uses_max_len():
    # ppo, A = +1, R = 1.1 on lengths (1, 2) of T = 3: token sums (-1.1, -2.2)
    # default max_len = T = 3: (-1.1 - 2.2) / (2 * 3) = -0.55 ; max_len 5: -3.3 / 10
    kw = dict(ratio=[[1.1, 1.0, 1.0], [1.1, 1.1, 1.0]], adv=[1.0, 1.0], mask=[[1, 0, 0], [1, 1, 0]])
    loss, grad, _ = run("ppo", agg="seq-mean-token-sum-norm", **kw)
    assert math.isclose(loss, -0.55, abs_tol=1e-12)
    assert close(grad, t([[-1.1, 0, 0], [-1.1, -1.1, 0]]) / 6)
    loss, _, _ = run("ppo", agg="seq-mean-token-sum-norm", max_len=5, **kw)
    assert math.isclose(loss, -0.33, abs_tol=1e-12)


# ---------------------------------------------------------------- naive reference


def naive_correction(spec, old, sampler, mask):
    """(weight, upper bound multiplier, kept) per token as nested lists, and the row weights:
    the spec written out with python floats (statistics over each row's masked tokens)."""
    batch, seq_len = mask.shape
    weight = [[1.0] * seq_len for _ in range(batch)]
    upper = [[1.0] * seq_len for _ in range(batch)]
    kept = [[False] * seq_len for _ in range(batch)]
    rows = [1.0] * batch
    for i in range(batch):
        idx = [j for j in range(seq_len) if mask[i, j] > 0]
        lw = {j: float(old[i, j] - sampler[i, j]) for j in idx}
        stats = {"sequence": math.exp(sum(lw.values())),
                 "geometric": math.exp(sum(lw.values()) / max(len(idx), 1))}
        vetoed = spec.veto is not None and any(not spec.veto <= math.exp(x) <= 1 / spec.veto for x in lw.values())
        if spec.weights in stats:
            rows[i] = min(max(stats[spec.weights], spec.weight_low), spec.weight_high)
        for j in idx:
            w = math.exp(lw[j])
            if spec.weights == "token":
                weight[i][j] = min(max(w, spec.weight_low), spec.weight_high)
            elif spec.weights != "none":
                weight[i][j] = rows[i]
            if spec.adaptive_clip:
                upper[i][j] = max(1.0, w / spec.weight_high)  # 1 / rho, rho = min(1, C / w)
            stat = w if spec.reject == "token" else stats.get(spec.reject)
            kept[i][j] = (stat is None or spec.reject_low <= stat <= spec.reject_high) and not vetoed
    return weight, upper, kept, rows


def _spec(hp, default="none"):
    c = hp.get("correction", default)
    return preset(c, hp.get("cap", 2.0)) if isinstance(c, str) else c


def _agg_coefs(kept, agg, max_len):
    """d(aggregate)/d(loss_it) for every token (``kept``: nested lists or a [B, T] tensor)."""
    rows = kept.tolist() if isinstance(kept, torch.Tensor) else kept
    seq_len = len(rows[0])
    total = sum(sum(r) for r in rows)
    n_rows = max(sum(1 for r in rows if sum(r) > 0), 1)  # rows with no token leave the count
    coefs = []
    for r in rows:
        length = sum(r)
        if agg == "token-mean":
            c = 1.0 / max(total, 1)
        elif agg == "seq-mean-token-mean":
            c = 1.0 / (n_rows * max(length, 1))
        else:
            c = 1.0 / (n_rows * (max_len or seq_len))
        coefs.append([c * float(m) for m in r])
    return coefs


def naive_token_loss(loss_type, logp, old, sampler, adv, mask, hp):
    """Per-token python loop: returns (loss value, gradient w.r.t. logp as nested lists)."""
    agg = hp.get("agg", "token-mean")
    if loss_type == "positive_only":
        mask = mask * (adv >= 0).to(mask.dtype)[:, None]
    weights, upper, kept, _ = naive_correction(_spec(hp), old, sampler, mask)
    coefs = _agg_coefs(kept, agg, hp.get("max_len"))
    value, grad = 0.0, []
    for i in range(logp.shape[0]):
        a = float(adv[i])
        grow = []
        for j in range(logp.shape[1]):
            if not kept[i][j]:
                grow.append(0.0)
                continue
            r = math.exp(float(logp[i, j] - old[i, j]))
            weight, hi_scale = weights[i][j], upper[i][j]
            if loss_type == "sapo":
                tau = hp.get("tau_neg", 1.05) if a < 0 else hp.get("tau_pos", 1.0)
                s = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
                loss_t, g = -(4.0 / tau) * s * a, -4.0 * s * (1.0 - s) * r * a
            else:
                lo, hi = 1.0 - hp.get("eps_low", 0.2), (1.0 + hp.get("eps_high", 0.2)) * hi_scale
                unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
                loss_t, g = (clipped, 0.0) if clipped > unclipped else (unclipped, -a * r)
                c = hp.get("dual_clip_c")
                if c is not None and a < 0 and loss_t > -c * a:
                    loss_t, g = -c * a, 0.0
            value += coefs[i][j] * weight * loss_t
            grow.append(coefs[i][j] * weight * g)
        grad.append(grow)
    return value, grad


def naive_seq_loss(loss_type, logp, old, sampler, adv, mask, hp):
    """Per-response python loop for gspo / tbpo."""
    batch = logp.shape[0]
    _, _, kept, v_rows = naive_correction(_spec(hp, "seq-tis" if loss_type == "tbpo" else "none"), old, sampler, mask)
    n_rows = max(sum(1 for r in kept if any(r)), 1)  # responses the correction emptied leave N
    value, grad = 0.0, []
    for i in range(batch):
        idx = [j for j in range(logp.shape[1]) if kept[i][j]]
        if not idx:
            grad.append([0.0] * logp.shape[1])
            continue
        length, a, v = len(idx), float(adv[i]), v_rows[i]
        s = math.exp(sum(float(logp[i, j] - old[i, j]) for j in idx) / length)
        if loss_type == "gspo":
            lo, hi = 1.0 - hp.get("eps_low", 3e-4), 1.0 + hp.get("eps_high", 4e-4)
            unclipped, clipped = -a * s, -a * min(max(s, lo), hi)
            loss_i, ds = (clipped, 0.0) if clipped > unclipped else (unclipped, -a)
        else:
            if a > 0:
                keep = s <= 1.0 + hp.get("eps_high", 4e-4)
            elif a < 0:
                keep = 1.0 - hp.get("delta_low", 3e-4) <= s <= 1.0 + hp.get("delta_high", 7e-4)
            else:
                keep = True
            loss_i, ds = (-a * s, -a) if keep else (0.0, 0.0)
        value += v * loss_i / n_rows
        # d s / d logp_t = s / L on each kept response token
        grad.append([v * ds * s / length / n_rows if kept[i][j] else 0.0 for j in range(logp.shape[1])])
    return value, grad


def random_batch(seed, lengths=(1, 7, 3, 0, 5, 7, 2, 7, 1, 4, 6, 7), seq_len=7, ratio_scale=0.4, w_scale=0.5):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    mask = torch.zeros(batch, seq_len, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    old = -torch.rand(batch, seq_len, generator=gen, dtype=F64) * 4 - 0.01
    logp = old + torch.randn(batch, seq_len, generator=gen, dtype=F64) * ratio_scale
    sampler = old - torch.randn(batch, seq_len, generator=gen, dtype=F64) * w_scale
    adv = torch.randn(batch, generator=gen, dtype=F64)
    return logp, old, sampler, adv, mask


# asymmetric bounds, rejection at each level, veto, sequence-level weights for a token loss
TOKEN_SPECS = (
    CorrectionSpec("token", 0.8, 1.3, reject="token", reject_low=0.55, reject_high=1.6),
    CorrectionSpec("geometric", 0.9, 1.2, reject="sequence", reject_low=0.3, reject_high=2.5, veto=0.35),
    CorrectionSpec("sequence", 0.5, 2.0, reject="geometric", reject_low=0.8, reject_high=1.25),
    CorrectionSpec("token", 0.0, 1.5, veto=0.4, adaptive_clip=True),
)
SEQ_SPECS = (
    CorrectionSpec("geometric", 0.7, 1.5, reject="token", reject_low=0.4, reject_high=2.2),
    CorrectionSpec("sequence", 0.4, 2.5, reject="geometric", reject_low=0.75, reject_high=1.3, veto=0.2),
)
TOKEN_CASES = (
    [("ppo", dict(correction=c, agg=a)) for c in ("none", "tis", "decoupled", "acr", "icepop") for a in AGG_MODES]
    + [("ppo", dict(dual_clip_c=1.5, eps_high=0.28, agg=a)) for a in AGG_MODES]
    + [("ppo", dict(agg="seq-mean-token-sum-norm", max_len=11, correction="acr", cap=1.5))]
    + [("positive_only", dict(agg=a, correction="tis")) for a in AGG_MODES]
    + [("sapo", dict(correction=c, agg=a)) for c in ("none", "tis", "decoupled", "icepop") for a in AGG_MODES]
    + [("sapo", dict(tau_pos=0.5, tau_neg=2.0))]
    + [("ppo", dict(correction=spec, agg=a)) for spec in TOKEN_SPECS for a in AGG_MODES]
    + [("sapo", dict(correction=TOKEN_SPECS[1], agg="seq-mean-token-mean"))]
    + [("positive_only", dict(correction=TOKEN_SPECS[0]))]
)
SEQ_CASES = [
    ("gspo", dict(correction=c, eps_low=0.05, eps_high=0.08)) for c in ("none", "seq-tis", "mis")
] + [
    ("gspo", dict()),
    ("tbpo", dict()),
    ("tbpo", dict(eps_high=0.05, delta_low=0.03, delta_high=0.07, cap=1.5)),
] + [("gspo", dict(correction=spec, eps_low=0.05, eps_high=0.08)) for spec in SEQ_SPECS] + [
    ("tbpo", dict(correction=spec, eps_high=0.05, delta_low=0.03, delta_high=0.07)) for spec in SEQ_SPECS
]


@pytest.mark.parametrize("loss_type,hp", TOKEN_CASES + SEQ_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_matches_naive_loop(loss_type, hp, seed):
    sequence = loss_type in ("gspo", "tbpo")
    # sequence losses need ratios near their narrow bands for both kept and dropped responses
    scale = (0.001 if hp.get("eps_high", 4e-4) < 1e-3 else 0.15) if sequence else 0.4
    logp, old, sampler, adv, mask = random_batch(seed, ratio_scale=scale, w_scale=1.0 if sequence else 0.5)
    naive = naive_seq_loss if sequence else naive_token_loss
    expected_value, expected_grad = naive(loss_type, logp, old, sampler, adv, mask, hp)
    leaf = logp.clone().requires_grad_()
    loss, metrics = compute_policy_loss(
        loss_type, logp=leaf, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask, **hp
    )
    loss.backward()
    assert math.isclose(loss.item(), expected_value, rel_tol=1e-10, abs_tol=1e-12)
    assert torch.allclose(leaf.grad, t(expected_grad), rtol=1e-10, atol=1e-12)
    assert COMMON_METRICS <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("loss_type", POLICY_LOSSES)
def test_padding_garbage_never_leaks(loss_type):
    # padding positions hold -inf / NaN: loss and gradient stay finite, gradient 0 there
    logp, old, sampler, adv, mask = random_batch(3, ratio_scale=0.0002)
    pad = mask == 0
    logp = logp.masked_fill(pad, float("nan")).requires_grad_()
    old, sampler = old.masked_fill(pad, float("-inf")), sampler.masked_fill(pad, float("nan"))
    loss, metrics = compute_policy_loss(
        loss_type, logp=logp, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[pad] == 0).all()
    assert all(math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------- invariants


@pytest.mark.parametrize("agg", AGG_MODES)
def test_on_policy_all_losses_give_the_policy_gradient(agg):
    # logp == old_logp == sampler_logp: every loss's gradient is the on-policy policy gradient
    # -A_i * d(agg)/d(loss_it): ppo/sapo under `agg`; gspo/tbpo are seq-mean-token-mean by construction.
    logp, _, _, adv, mask = random_batch(7)
    expected = {
        a: -adv[:, None] * t(_agg_coefs(mask, a, None)) for a in AGG_MODES
    }
    for loss_type, hp, norm in [
        ("ppo", dict(agg=agg), agg),
        ("sapo", dict(agg=agg), agg),
        ("gspo", dict(), "seq-mean-token-mean"),
        ("tbpo", dict(), "seq-mean-token-mean"),
    ]:
        for correction in ({"ppo": ("none", "tis", "decoupled", "acr", "icepop"),
                            "sapo": ("none", "tis", "decoupled", "icepop"),
                            "gspo": ("none", "seq-tis", "mis"), "tbpo": (None,)}[loss_type]):
            kw = dict(hp) if correction is None else dict(hp, correction=correction)
            leaf = logp.clone().requires_grad_()
            loss, metrics = compute_policy_loss(
                loss_type, logp=leaf, old_logp=logp, sampler_logp=logp, advantages=adv, mask=mask, **kw
            )
            loss.backward()
            assert torch.allclose(leaf.grad, expected[norm], rtol=1e-12, atol=1e-15), (loss_type, correction)
            assert metrics["loss/clip_frac"] == 0.0
            assert metrics["correction/w_mean"] == 1.0 and metrics["correction/w_max"] == 1.0
    # the normalisations only rescale: seq-mean-token-mean with equal lengths == token-mean
    full = torch.ones_like(mask)
    assert torch.allclose(t(_agg_coefs(full, "token-mean", None)), t(_agg_coefs(full, "seq-mean-token-mean", None)))


def test_gradient_flows_only_through_logp():
    logp, old, sampler, adv, mask = random_batch(5, ratio_scale=0.0002)
    old, sampler, adv = (x.clone().requires_grad_() for x in (old, sampler, adv))
    for loss_type in POLICY_LOSSES:
        leaf = logp.clone().requires_grad_()
        loss, _ = compute_policy_loss(
            loss_type, logp=leaf, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask
        )
        loss.backward()
        assert leaf.grad is not None
        assert old.grad is None and sampler.grad is None and adv.grad is None, loss_type


def test_token_losses_accept_token_advantages():
    # [B] advantages and the same values broadcast to [B, T] give identical results
    logp, old, sampler, adv, mask = random_batch(2)
    for loss_type in ("ppo", "positive_only", "sapo"):
        a = compute_policy_loss(loss_type, logp=logp, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask)
        b = compute_policy_loss(
            loss_type, logp=logp, old_logp=old, sampler_logp=sampler,
            advantages=adv[:, None].expand_as(logp).clone(), mask=mask,
        )
        assert a[0].item() == b[0].item() and a[1] == b[1]


# ---------------------------------------------------------------- errors


def test_unknown_names_raise_listing_valid_ones():
    logp, old, sampler, adv, mask = random_batch(0)
    kw = dict(logp=logp, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask)
    with pytest.raises(ValueError, match="valid: ppo, positive_only, sapo, gspo, tbpo"):
        compute_policy_loss("grpo", **kw)
    with pytest.raises(ValueError, match="unknown hyperparameter.*eps_clip.*valid: eps_low"):
        compute_policy_loss("ppo", eps_clip=0.2, **kw)
    with pytest.raises(ValueError, match="agg"):
        compute_policy_loss("gspo", agg="token-mean", **kw)
    with pytest.raises(ValueError, match="valid: none, tis, decoupled, acr, icepop"):
        compute_policy_loss("ppo", correction="mis", **kw)
    with pytest.raises(ValueError, match="valid: none, seq-tis, mis"):
        compute_policy_loss("gspo", correction="tis", **kw)
    with pytest.raises(ValueError, match="valid: none, tis, decoupled, icepop"):
        compute_policy_loss("sapo", correction="acr", **kw)
    with pytest.raises(ValueError, match="valid: token-mean"):
        compute_policy_loss("ppo", agg="sum", **kw)
    with pytest.raises(ValueError, match="dual_clip_c"):
        compute_policy_loss("ppo", dual_clip_c=0.5, **kw)
    with pytest.raises(ValueError, match="cap"):
        compute_policy_loss("tbpo", cap=0.5, **kw)


def test_shape_errors():
    logp, old, sampler, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match=r"advantages for 'gspo' must be \(12,\)"):
        compute_policy_loss("gspo", logp=logp, old_logp=old, sampler_logp=sampler,
                            advantages=adv[:, None].expand_as(logp), mask=mask)
    with pytest.raises(ValueError, match="old_logp"):
        compute_policy_loss("ppo", logp=logp, old_logp=old[:, :3], sampler_logp=sampler, advantages=adv, mask=mask)


def test_defaults_are_the_documented_ones():
    assert policy_loss_defaults("ppo") == dict(
        eps_low=0.2, eps_high=0.2, dual_clip_c=None, correction="none", cap=2.0, agg="token-mean", max_len=None
    )
    assert policy_loss_defaults("positive_only") == policy_loss_defaults("ppo")
    assert policy_loss_defaults("sapo") == dict(
        tau_pos=1.0, tau_neg=1.05, correction="none", cap=2.0, agg="token-mean", max_len=None
    )
    assert policy_loss_defaults("gspo") == dict(eps_low=3e-4, eps_high=4e-4, correction="none", cap=2.0)
    assert policy_loss_defaults("tbpo") == dict(eps_high=4e-4, delta_low=3e-4, delta_high=7e-4,
                                                correction="seq-tis", cap=2.0)


@pytest.mark.parametrize("loss_type", POLICY_LOSSES)
def test_on_device_metrics_are_the_float_metrics_as_tensors(loss_type):
    """``on_device=True`` hands over the same metrics as 0-d tensors (the learner reads them
    once per mini-batch) and the same loss."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 2
    old = logp + 0.1 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    sampler = old + 0.05 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * 6, [1.0] * 4 + [0.0] * 2, [0.0] * 6], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    args = dict(logp=logp, old_logp=old, sampler_logp=sampler, advantages=adv, mask=mask)
    loss, host = compute_policy_loss(loss_type, **args)
    loss_d, dev = compute_policy_loss(loss_type, on_device=True, **args)
    assert torch.equal(loss, loss_d) and set(host) == set(dev)
    for k, v in dev.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad
        assert v.item() == host[k] or (math.isnan(host[k]) and math.isnan(v.item()))
