"""Batch-invariant row kernels under TRITON_INTERPRET=1 on CPU: RMSNorm (with and without the
residual add, quarl.quant.kernels.invariant_norm) and the vocabulary log-softmax
(quarl.quant.kernels.invariant_softmax), also behind the invariant LM head GEMM.

For each: (i) a float64 reference within a bound derived from the kernel's roundings;
(ii) a row's outputs bit-identical alone and inside batches of 2, 7, 33 and 64 random rows
of very different magnitudes, at the first, a middle and the last position; (iii) empty
batches and leading dimensions. Row lengths are not multiples of the block (the loop's
masked tail is exercised) and span several blocks (the per-lane accumulation is)."""

import pytest
import torch

from quarl.model.transformer import rms_norm

pytestmark = pytest.mark.usefixtures("needs_triton")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
U = {F32: 2.0**-24, BF16: 2.0**-8, F16: 2.0**-11}
H, V = 200, 1000  # interpreter blocks: 64 (norm), 128 (softmax): 4 and 8 chunks, partial last ones
SIZES = (2, 7, 33, 64)


def _norm():
    from quarl.quant.kernels import invariant_norm

    return invariant_norm


def _softmax():
    from quarl.quant.kernels import invariant_softmax

    return invariant_softmax


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _others(m, n, dtype, spread=2.0):
    o = torch.randn(m, n) * torch.logspace(-spread, spread, m)[:, None]
    if m > 2:
        o[m // 3] = 0
    return o.to(dtype)


def _embedded(row, m, pos, dtype, spread=2.0):
    batch = _others(m, row.shape[-1], dtype, spread)
    batch[pos] = row
    return batch


def _positions(m):
    return sorted({0, m // 2, m - 1})


# ------------------------------------------------------------------------------- RMSNorm

NORM_CASES = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)]  # (x dtype, weight dtype)
NORM_IDS = [f"x{str(a).split('.')[-1]}-w{str(b).split('.')[-1]}" for a, b in NORM_CASES]


def _norm_reference_check(x, w, eps, y, residual=None, r_new=None):
    """``|y - ref| <= (u_x + u_y + (N + 8) u32) |ref|``: the sum of squares and rstd in fp32,
    one rounding to x's dtype before the weight, one of the product to the output dtype."""
    s = x if residual is None else (residual + x)  # torch rounds the add to x's dtype once
    if residual is not None:
        assert _same_bits(r_new, s)
    s64 = s.double()
    ref = w.double() * (s64 / torch.sqrt(s64.pow(2).mean(-1, keepdim=True) + eps))
    out_dtype = torch.promote_types(w.dtype, x.dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    allow = (U[x.dtype] + U[out_dtype] + (x.shape[-1] + 8) * 2.0**-24) * ref.abs() * 1.01 + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= allow).all()), float((err / allow).max())


@pytest.mark.parametrize("xd,wd", NORM_CASES, ids=NORM_IDS)
def test_rms_norm_matches_float64_reference(xd, wd):
    inv = _norm()
    x = (torch.randn(13, H) * torch.logspace(-3, 3, 13)[:, None]).to(xd)
    w = (1 + 0.3 * torch.randn(H)).to(wd)
    _norm_reference_check(x, w, 1e-6, inv.invariant_rms_norm(x, w, 1e-6))
    r = torch.randn(13, H).to(xd)
    y, r_new = inv.invariant_rms_norm(x, w, 1e-6, residual=r)
    _norm_reference_check(x, w, 1e-6, y, r, r_new)


@pytest.mark.parametrize("xd,wd", NORM_CASES, ids=NORM_IDS)
def test_rms_norm_agrees_with_the_models_norm(xd, wd):
    """Within one rounding of the output of quarl.model.transformer.rms_norm (the learner's op
    outside exact mode): the same steps, only the sum's order may differ."""
    x = torch.randn(9, H).to(xd)
    w = (1 + 0.3 * torch.randn(H)).to(wd)
    y = _norm().invariant_rms_norm(x, w, 1e-5)
    ref = rms_norm(x, w, 1e-5)
    assert y.dtype == ref.dtype
    tol = 2 * (U[xd] + U[y.dtype]) * ref.double().abs() + 1e-30
    assert bool(((y.double() - ref.double()).abs() <= tol).all())


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("xd,wd", NORM_CASES, ids=NORM_IDS)
def test_rms_norm_row_is_bit_identical_at_any_batch_size_and_position(xd, wd, with_residual):
    inv = _norm()
    w = (1 + 0.3 * torch.randn(H)).to(wd)
    row, res_row = torch.randn(1, H).to(xd), torch.randn(1, H).to(xd)

    def run(x, r):
        out = inv.invariant_rms_norm(x, w, 1e-6, residual=r if with_residual else None)
        return out if with_residual else (out, None)

    alone_y, alone_r = run(row, res_row)
    for m in SIZES:
        for pos in _positions(m):
            y, r_new = run(_embedded(row[0], m, pos, xd), _embedded(res_row[0], m, pos, xd))
            assert _same_bits(y[pos], alone_y[0]), (m, pos)
            if with_residual:
                assert _same_bits(r_new[pos], alone_r[0]), (m, pos)


def test_rms_norm_leading_dims_and_empty():
    inv = _norm()
    w = torch.randn(H).to(BF16)
    x = torch.randn(2, 3, H).to(BF16)
    y = inv.invariant_rms_norm(x, w, 1e-6)
    assert y.shape == (2, 3, H) and _same_bits(y[1, 2], inv.invariant_rms_norm(x[1, 2:3], w, 1e-6)[0])
    empty = inv.invariant_rms_norm(torch.empty(0, H, dtype=BF16), w, 1e-6)
    assert empty.shape == (0, H) and empty.dtype == BF16
    with pytest.raises(ValueError, match="weight"):
        inv.invariant_rms_norm(x, torch.ones(H + 1), 1e-6)


def test_norm_block_has_no_row_count_argument():
    import inspect

    inv = _norm()
    assert list(inspect.signature(inv.norm_config).parameters) == ["n", "interpret"]
    assert inv.norm_config(3584) == (4096, 8, 1) and inv.norm_config(896) == (1024, 4, 1)
    assert inv.norm_config(200, interpret=True) == (64, 4, 16)  # several rows per program: a tile's rows never mix


# ---------------------------------------------------------------------------- log-softmax


def _logits(r, v, dtype, spread=1.0):
    x = torch.randn(r, v) * torch.logspace(0, spread, r)[:, None] * 3
    return x.to(dtype)


def _softmax_reference(logits, targets, inv_t):
    """float64 lse / logp / entropy of ``x = fp32(logits) * fp32(inv_t)`` (the kernel's x exactly)."""
    x = (logits.float() * torch.tensor(inv_t, dtype=F32)).double()
    lse = torch.logsumexp(x, -1)
    logp = x.gather(-1, targets[:, None])[:, 0] - lse
    p = torch.softmax(x, -1)
    ent = lse - (p * x).sum(-1)
    return logp, lse, ent, x.abs().amax(-1)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("inv_t", [1.0, 1 / 0.7])
def test_logsoftmax_matches_float64_reference(dtype, inv_t):
    """``|lse - ref| <= (V + 16) u32 + 2 u32 |ref|`` (fp32 exps and sums over V terms, one
    rounding of ``M + log S``); the target's logp adds one rounding, the entropy a sum of
    ``p x`` terms bounded by the row's max ``|x|``."""
    logits = _logits(11, V, dtype)
    logits[3, 17] = 60  # one dominant token
    targets = torch.randint(0, V, (11,))
    logp, lse, ent = _softmax().invariant_token_logprobs(logits, targets, inv_t, with_entropy=True)
    r_logp, r_lse, r_ent, xmax = _softmax_reference(logits, targets, inv_t)
    u = 2.0**-24
    allow = (V + 16) * u + 2 * u * r_lse.abs()
    assert logp.dtype == lse.dtype == ent.dtype == F32
    assert bool(((lse.double() - r_lse).abs() <= allow).all())
    assert bool(((logp.double() - r_logp).abs() <= allow + 2 * u * r_logp.abs()).all())
    assert bool(((ent.double() - r_ent).abs() <= (V + 16) * u * (1 + xmax) * 2 + allow).all())


def test_logsoftmax_without_entropy_returns_two():
    out = _softmax().invariant_token_logprobs(_logits(3, 50, F32), torch.tensor([0, 7, 49]))
    assert len(out) == 2 and out[0].shape == (3,)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_logsoftmax_row_is_bit_identical_at_any_batch_size_and_position(dtype):
    inv = _softmax()
    row, tgt = _logits(1, V, dtype), torch.tensor([123])
    alone = inv.invariant_token_logprobs(row, tgt, 1 / 0.7, with_entropy=True)
    for m in SIZES:
        for pos in _positions(m):
            batch = _embedded(row[0], m, pos, dtype, spread=1.0) * 3
            batch[pos] = row[0]
            targets = torch.randint(0, V, (m,))
            targets[pos] = tgt[0]
            got = inv.invariant_token_logprobs(batch, targets, 1 / 0.7, with_entropy=True)
            for a, b in zip(got, alone):
                assert _same_bits(a[pos], b[0]), (m, pos)


def test_lm_head_and_logsoftmax_row_is_bit_identical_at_any_batch_size():
    """The LM head through the invariant GEMM, then the log-softmax: a token's log-prob from its
    hidden state alone equals the one inside batches (what engine and learner both run)."""
    from quarl.quant.kernels.invariant import dense_gemm

    inv = _softmax()
    head = (torch.randn(V, 48) * 0.2).to(BF16)
    h, tgt = torch.randn(1, 48).to(BF16), torch.tensor([5])
    alone = inv.invariant_token_logprobs(dense_gemm(h, head), tgt)[0]
    for m in (3, 33):
        for pos in _positions(m):
            batch = _embedded(h[0], m, pos, BF16, spread=1.0)
            targets = torch.randint(0, V, (m,))
            targets[pos] = tgt[0]
            assert _same_bits(inv.invariant_token_logprobs(dense_gemm(batch, head), targets)[0][pos], alone[0])


def test_logsoftmax_leading_dims_and_empty():
    inv = _softmax()
    logits = _logits(6, 77, F32).view(2, 3, 77)
    targets = torch.randint(0, 77, (2, 3))
    logp, lse = inv.invariant_token_logprobs(logits, targets)
    assert logp.shape == lse.shape == (2, 3)
    assert _same_bits(logp[1, 1], inv.invariant_token_logprobs(logits[1, 1:2], targets[1, 1:2])[0][0])
    e_logp, e_lse = inv.invariant_token_logprobs(torch.empty(0, 77), torch.empty(0, dtype=torch.long))
    assert e_logp.shape == (0,)
    with pytest.raises(ValueError, match="targets"):
        inv.invariant_token_logprobs(logits, targets[0])


def test_logsoftmax_per_row_temperatures_equal_one_temperature_per_call():
    """The engine's rows carry their own ``1 / T`` (a tensor), the learner one float for the
    batch: a row gets the same bits either way, and a row of 1 / T = 1 the plain log-softmax's."""
    inv = _softmax()
    logits, targets = _logits(5, V, BF16), torch.randint(0, V, (5,))
    temps = [1.0, 0.7, 1.3, 0.7, 1.0]
    inv_t = torch.tensor([1.0 / t for t in temps], dtype=F32)
    per_row = inv.invariant_token_logprobs(logits, targets, inv_t, with_entropy=True)
    for i, t in enumerate(temps):
        one = inv.invariant_token_logprobs(logits, targets, 1.0 / t, with_entropy=True)
        for a, b in zip(per_row, one):
            assert _same_bits(a[i], b[i]), (i, t)
    r_logp = _softmax_reference(logits, targets, 1 / 0.7)[0]
    assert bool(((per_row[0][1].double() - r_logp[1]).abs() < 1e-4))
    assert not _same_bits(per_row[0][1], inv.invariant_token_logprobs(logits, targets)[0][1])
    with pytest.raises(ValueError, match="temperatures"):
        inv.invariant_token_logprobs(logits, targets, inv_t[:3])
