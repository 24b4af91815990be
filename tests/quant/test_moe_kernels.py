"""The grouped int4 MoE kernel (quarl.quant.kernels.moe_gemm, TRITON_INTERPRET=1 on CPU) against
a float64 loop over experts, and its dispatch in quarl.quant.experts.grouped_quant_linear."""

from __future__ import annotations

import random

import pytest
import torch

from quarl.model.moe import sort_by_expert
from quarl.quant import SCHEMES, get_scheme, quantize_weight, use_backend
from quarl.quant.experts import QATExperts, QuantExperts, grouped_quant_linear
from quarl.quant.kernels.w4_layout import RepackCache
from tests.quant import sass_count

pytestmark = pytest.mark.usefixtures("needs_triton")

SUPPORTED = ["w4a16", "w4a16-asym", "w8a8-int8", "w8a8-fp8"]  # int4 groups; 8-bit codes, a scale per channel
UNSUPPORTED = ["w4a8-int8", "w2a16", "mxfp4", "nvfp4"]
DTYPES = [torch.bfloat16, torch.float16]  # bf16: the interpreter's fp32 stand-in (grouped_gemm); fp16: as on GPU
N, K = 40, 200  # N not a multiple of the tile, K not of the 128-column chunk (Kp = 256)


def _moe_gemm():
    from quarl.quant.kernels import moe_gemm

    return moe_gemm


def _weight(name: str, e: int, n: int = N, k: int = K, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e * n, k, generator=g) * torch.logspace(-2, 0, e).repeat_interleave(n)[:, None]
    return quantize_weight(w, name)


def _reference(x: torch.Tensor, offsets: torch.Tensor, qw, e: int) -> torch.Tensor:
    """float64 ``x_e @ W_e^T`` per expert over the weight dequantized to x's dtype (the values
    the dequantize path and the kernel both multiply)."""
    n = qw.out_features // e
    w = qw.dequantize(x.dtype).double().view(e, n, qw.in_features)
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        y[start:end] = x[start:end].double() @ w[i].T
        start = end
    return y


def _assert_rounded_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """``y`` is ``ref`` rounded to y's dtype, up to fp32 accumulation (which may move a value
    across a rounding midpoint: one half-ulp bound plus a tiny absolute slack)."""
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[y.dtype]
    err = (y.double() - ref).abs()
    bound = half_ulp * ref.abs() + 1e-5 * ref.abs().max().clamp_min(1e-30)
    assert (err <= bound).all(), float((err - bound).max())
    assert (y == ref.to(y.dtype)).float().mean() > 0.97  # nearly all rounded like the float64 sum


def _counts_offsets(counts: list[int]) -> tuple[torch.Tensor, int]:
    return torch.tensor(counts).cumsum(0).to(torch.int32), sum(counts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SUPPORTED)
def test_kernel_equals_float64_loop_over_experts(name, dtype):
    """Experts with 0 rows (first and last too), 1 row, rows over several tiles, a tile's worth
    plus one (17 rows of 16-row tiles: the tile bound's worst case); tile configs in both operand
    orders (swap: the weight as the dot's first operand)."""
    moe_gemm = _moe_gemm()
    counts = [0, 1, 37, 5, 0, 17, 16, 0]
    e = len(counts)
    qw = _weight(name, e)
    offsets, m = _counts_offsets(counts)
    x = torch.randn(m, K).to(dtype)
    ref = _reference(x, offsets, qw, e)
    for cfg in (None, moe_gemm.MoeConfig(16, 16, group_m=2), moe_gemm.MoeConfig(32, 64, group_m=1),
                moe_gemm.MoeConfig(16, 32, group_m=2, swap=True), moe_gemm.MoeConfig(32, 16, group_m=1, swap=True)):
        y = moe_gemm.grouped_gemm(x, offsets, qw, e, cfg)
        assert y.dtype == dtype and y.shape == (m, N)
        _assert_rounded_close(y, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_experts_equal_float64_and_a_row_keeps_its_bits_in_any_group(dtype):
    """grouped_gemm_dense (16-bit experts read as they are, exact mode's path) against the float64
    loop; at one fixed tile a row's output bits do not depend on the other rows of its expert
    (alone, or among 36 others), in either operand order."""
    moe_gemm = _moe_gemm()
    counts = [0, 1, 37, 5, 0, 17, 16, 0]
    e = len(counts)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(e, N, K, generator=g) * 0.1).to(dtype)
    offsets, m = _counts_offsets(counts)
    x = torch.randn(m, K, generator=g).to(dtype)
    ref = torch.zeros(m, N, dtype=torch.float64)
    for i, (start, end) in enumerate(zip([0] + offsets.tolist()[:-1], offsets.tolist())):
        ref[start:end] = x[start:end].double() @ w[i].double().T
    for cfg in (moe_gemm.MoeConfig(16, 32, 4, 1), moe_gemm.MoeConfig(16, 32, 4, 1, swap=True)):
        y = moe_gemm.grouped_gemm_dense(x, offsets, w, cfg)
        _assert_rounded_close(y, ref)
        row = 1 + 20  # a row of expert 2 (rows 1..37)
        alone = torch.zeros(e, dtype=torch.int32)
        alone[2:] = 1
        assert torch.equal(moe_gemm.grouped_gemm_dense(x[row:row + 1], alone, w, cfg)[0], y[row])
    with pytest.raises(ValueError, match="one 16-bit dtype and K"):
        moe_gemm.grouped_gemm_dense(x, offsets, w.float())


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("name", SUPPORTED)
def test_kernel_on_sorted_top_k_rows(name, top_k):
    """Rows gathered in the order sort_by_expert gives (top-1 and top-k routing), with the
    offsets it makes on the device; the down projection's shape too (K = I, N = H)."""
    moe_gemm = _moe_gemm()
    e, tokens, hidden, inter = 6, 11, 72, 48
    g = torch.Generator().manual_seed(top_k)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    order, offsets = sort_by_expert(ids, e)
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        qw = _weight(name, e, n, k, seed=n)
        x = torch.randn(tokens, k, dtype=torch.float16)[order // top_k]
        _assert_rounded_close(moe_gemm.grouped_gemm(x, offsets, qw, e), _reference(x, offsets, qw, e))


def test_kernel_edge_shapes():
    """No rows at all, one row in the last expert, every row in one expert, a single expert."""
    moe_gemm = _moe_gemm()
    qw = _weight("w4a16", 4)
    for counts in ([0, 0, 0, 0], [0, 0, 0, 1], [0, 40, 0, 0]):
        offsets, m = _counts_offsets(counts)
        x = torch.randn(m, K, dtype=torch.float16)
        y = moe_gemm.grouped_gemm(x, offsets, qw, 4)
        assert y.shape == (m, N)
        if m:
            _assert_rounded_close(y, _reference(x, offsets, qw, 4))
    one = _weight("w4a16-asym", 1, 24, 130)
    offsets, m = _counts_offsets([33])
    x = torch.randn(m, 130, dtype=torch.float16)
    _assert_rounded_close(moe_gemm.grouped_gemm(x, offsets, one, 1), _reference(x, offsets, one, 1))


def test_tile_bound_covers_every_routing_and_config_rule():
    moe_gemm = _moe_gemm()
    rnd = random.Random(0)
    for _ in range(300):
        e, bm = rnd.choice([1, 3, 8, 128]), rnd.choice([16, 32, 64, 128])
        m = rnd.randint(0, 600)
        cuts = sorted(rnd.randint(0, m) for _ in range(e - 1))
        counts = [b - a for a, b in zip([0] + cuts, cuts + [m])]
        assert sum(-(-c // bm) for c in counts) <= moe_gemm.tile_bound(m, e, bm)
    # decode (a few rows per expert) takes 16-row tiles, prefill larger ones
    assert moe_gemm.pick_config(64 * 8, 128).bm == 16
    assert moe_gemm.pick_config(4096 * 8, 128).bm == 128
    sizes = [moe_gemm.pick_config(m, 128).bm for m in (1, 2048, 8192, 16384, 1 << 17)]
    assert sizes == sorted(sizes)


def test_kernel_refuses_what_it_cannot_read():
    moe_gemm = _moe_gemm()
    qw = _weight("w4a16", 2)
    offsets = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="int4"):
        moe_gemm.grouped_gemm(torch.randn(5, K).half(), offsets, _weight("w2a16", 2), 2)
    with pytest.raises(ValueError, match="bf16"):
        moe_gemm.grouped_gemm(torch.randn(5, K), offsets, qw, 2)
    with pytest.raises(ValueError, match="offsets"):
        moe_gemm.grouped_gemm(torch.randn(5, K).half(), offsets.long(), qw, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
def test_one_hot_rows_read_back_the_dequantized_weights_bit_for_bit(name, dtype):
    """Row ``j`` of expert ``e`` with a 1 in column ``j`` gives expert e's dequantized column
    ``j`` exactly (every other product is zero): the kernel's dequantization (bf16: the codes
    as bf16 ``128 + code`` by their bits, less ``128 + z``) is ``dequantize``'s, value for value."""
    moe_gemm = _moe_gemm()
    e, n, k = 2, 24, 130
    qw = _weight(name, e, n, k, seed=9)
    want = qw.dequantize(dtype).view(e, n, k).transpose(1, 2).reshape(e * k, n)
    x = torch.eye(k, dtype=dtype).repeat(e, 1)
    offsets = torch.tensor([k, 2 * k], dtype=torch.int32)
    for cfg in (None, moe_gemm.MoeConfig(16, 16, group_m=2, swap=True)):
        assert torch.equal(moe_gemm.grouped_gemm(x, offsets, qw, e, cfg), want)


@pytest.mark.parametrize("gated", [True, False], ids=["gate_up-fused", "plain"])
def test_the_int4_decode_loop_spends_few_instructions_a_weight(gated):
    """The decode tile's main loop compiled for Hopper (no GPU needed: tests/quant/sass_count.py)
    dequantizes a packed int4 weight in about four instructions: one PRMT a pair of weights
    (the inline PTX of ``_W4_LOW``; Triton's own byte extension spent three), one packed
    subtract and one packed multiply a pair, the rest shared by the tile (loads, the x
    operand, the MMAs). At ~6 a weight the kernel was bound by instruction issue at 58% of its
    memory floor (docs/moe.md); full bandwidth leaves about 5 (docs/kernels.md)."""
    moe_gemm = _moe_gemm()
    cfg = moe_gemm.pick_config(8 * 128, 128)  # Qwen3-30B-A3B decode: ~8 rows an expert
    got = sass_count.count("moe", 4, cfg.bm, cfg.bn, cfg.num_warps, cfg.num_stages, int(cfg.swap), int(gated))
    per_weight = got["loop"] / got["weights_per_thread"]
    assert per_weight < (4.2 if gated else 5.0), got  # (3.9 and 4.6 now; 5.7 and 6.2 with Triton's unpacking)
    assert got["ops"]["PRMT"] <= got["weights_per_thread"] / 2, got
    # the loop found is the K loop: its m16n8k16 MMAs, each warp's BN / warps columns over BK = 128
    mmas = cfg.bn // cfg.num_warps // 8 * (moe_gemm.BK // 16) * (2 if gated else 1)
    assert got["ops"]["HMMA"] == mmas, got


def _unfused(x, ids, w, gate_up, down, e):
    """run_experts' steps around the kernel, one by one: the gathered rows, the plain gate/up
    GEMM, torch's SiLU-and-mul, the plain down GEMM, the scatter back and the weights."""
    moe_gemm = _moe_gemm()
    n, k = ids.shape
    order, offsets = sort_by_expert(ids, e)
    rows = x.unsqueeze(1).expand(n, k, x.shape[1]).reshape(n * k, -1)[order]
    gate, up = moe_gemm.grouped_gemm(rows, offsets, gate_up, e).chunk(2, dim=-1)
    hidden = torch.nn.functional.silu(gate) * up
    out = moe_gemm.grouped_gemm(hidden, offsets, down, e)
    per_slot = torch.empty_like(out).index_copy_(0, order, out) * w.reshape(-1, 1)
    return order, offsets, hidden, per_slot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SUPPORTED)
def test_fused_gather_swiglu_and_weighted_scatter_equal_the_unfused_steps(name, dtype):
    """gate/up with the gather (each pair reads its token's row in place) and SiLU-and-mul in
    the epilogue, then down with the scatter to (token, slot) order times the routing weights:
    the unfused steps' values. The scatter has no transcendental: bit for bit. SiLU's exp may
    differ from torch's in the last fp32 bit, which moves a rounded value by one step at most
    and seldom."""
    moe_gemm = _moe_gemm()
    e, tokens, k, hidden_size, inter = 6, 13, 3, 72, 40
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(tokens)])  # the last expert: no rows
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dtype)
    x = (torch.randn(tokens, hidden_size, generator=g)).to(dtype)
    gate_up = _weight(name, e, 2 * inter, hidden_size, seed=3)
    down = _weight(name, e, hidden_size, inter, seed=4)
    order, offsets, hidden_ref, per_slot_ref = _unfused(x, ids, w, gate_up, down, e)
    for cfg in (None, moe_gemm.MoeConfig(16, 16, group_m=2, swap=True)):
        hidden = moe_gemm.grouped_gemm(x, offsets, gate_up, e, cfg, gated=True, order=order, slots=k)
        assert hidden.shape == hidden_ref.shape and hidden.dtype == dtype
        step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype] * hidden_ref.double().abs()
        assert ((hidden.double() - hidden_ref.double()).abs() <= step).all()
        assert (hidden == hidden_ref).float().mean() > 0.99
        per_slot = moe_gemm.grouped_gemm(hidden_ref, offsets, down, e, cfg, order=order, route_weights=w.reshape(-1))
        assert torch.equal(per_slot, per_slot_ref)


def test_fused_steps_refuse_inconsistent_arguments():
    moe_gemm = _moe_gemm()
    qw = _weight("w4a16", 2)
    offsets = torch.tensor([3, 5], dtype=torch.int32)
    x = torch.randn(5, K).half()
    with pytest.raises(ValueError, match="order"):
        moe_gemm.grouped_gemm(x, offsets, qw, 2, route_weights=torch.ones(5).half())
    with pytest.raises(ValueError, match="pairs"):
        moe_gemm.grouped_gemm(x, offsets, qw, 2, order=torch.arange(4), route_weights=torch.ones(4).half())
    with pytest.raises(ValueError, match="gated"):
        moe_gemm.grouped_gemm(x, offsets, _weight("w4a16", 2, 21), 2, gated=True)


# ------------------------------------------------------------------------------ the dispatch
E, H, INTER = 5, 64, 48  # K = 64 and 48: both padded to the 128-column chunk


def _engine(name: str, dtype: torch.dtype) -> QuantExperts:
    g = torch.Generator().manual_seed(0)
    qx = QuantExperts(H, INTER, E, name, dtype=dtype)
    qx.load_quantized({"gate_up_proj": torch.randn(E, 2 * INTER, H, generator=g) * 0.1,
                       "down_proj": torch.randn(E, H, INTER, generator=g) * 0.1})
    return qx


def _routing(tokens: int, k: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(tokens)])  # expert 4: no rows
    return ids, torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The grouped kernel's calls (it still runs)."""
    moe_gemm = _moe_gemm()
    calls = []
    real = moe_gemm.grouped_gemm

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(moe_gemm, "grouped_gemm", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SUPPORTED)
def test_quant_experts_forward_on_the_kernel_equals_the_reference_path(name, dtype, kernel_calls):
    """QuantExperts with the Triton backend forced runs the kernel for both projections and
    gives the reference path's values up to 16-bit rounding of the weights (and of the rows as
    the GEMM sees them, for W8A8; the reference works in float64 on the CPU) and fp32
    accumulation."""
    qx = _engine(name, dtype)
    x = torch.randn(9, H).to(dtype)
    ids, w = _routing(9, 2, dtype)
    with torch.inference_mode():
        with use_backend("reference"):
            want = qx(x, ids, w)
        assert not kernel_calls
        with use_backend("triton"):
            got = qx(x, ids, w)
    assert kernel_calls == [(9, H), (18, INTER)]  # fused: gate/up reads x's 9 token rows for the 18 pairs
    assert got.dtype == dtype
    rel = float((got.double() - want.double()).norm() / want.double().norm())
    # W8A8: the reference sums the codes in float64; the kernel takes the rows and weights
    # rounded to 16 bits (what the GPU's dequantize path multiplies), and a last-bit change in
    # the SwiGLU output can move a code step when down's rows are quantized again
    assert rel < (1e-2 if dtype == torch.bfloat16 or get_scheme(name).quantizes_activations else 2e-3), rel


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_dispatch_falls_back_for_other_schemes(name, kernel_calls):
    sc = get_scheme(name)
    qw = quantize_weight(torch.randn(E * 2 * INTER, H) * 0.1, sc)
    offsets = torch.tensor([2, 4, 6, 8, 9], dtype=torch.int32)
    with use_backend("triton"), torch.inference_mode():
        y = grouped_quant_linear(torch.randn(9, H).bfloat16(), qw, offsets, E)
    assert y.shape == (9, 2 * INTER) and not kernel_calls


def test_dispatch_keeps_the_dequantized_path_where_it_should(kernel_calls):
    """The learner (a master weight), a dense copy kept by the owner, rows that need a
    gradient, fp32 rows and the auto backend on the CPU keep the dequantize + grouped GEMM."""
    qw = quantize_weight(torch.randn(E * 2 * INTER, H) * 0.1, "w4a16")
    offsets = torch.tensor([2, 4, 6, 8, 9], dtype=torch.int32)
    x = torch.randn(9, H).bfloat16()
    master = torch.zeros(E, 2 * INTER, H, dtype=torch.bfloat16)
    with use_backend("triton"):
        grouped_quant_linear(x, qw, offsets, E, master=master)
        grouped_quant_linear(x, qw, offsets, E, RepackCache(dense=True))
        grouped_quant_linear(x.clone().requires_grad_(), qw, offsets, E)
        grouped_quant_linear(x.float(), qw, offsets, E)
        assert not kernel_calls
        with torch.no_grad():
            grouped_quant_linear(x.clone().requires_grad_(), qw, offsets, E)
        assert len(kernel_calls) == 1
    with use_backend("auto"):
        grouped_quant_linear(x, qw, offsets, E)
    assert len(kernel_calls) == 1
    # the aligned learner's experts never take it
    qat = QATExperts(H, INTER, E, "w4a16", dtype=torch.bfloat16)
    ids, w = _routing(4, 2, torch.bfloat16)
    with use_backend("triton"), torch.no_grad():
        qat(x[:4], ids, w)
    assert len(kernel_calls) == 1


def test_dispatch_takes_the_kernel_for_exactly_its_schemes(kernel_calls):
    """The schemes the kernel reads are int4 groups and 8-bit per-channel codes, and the
    dispatch in experts.py (which asks without importing triton) sends exactly those to it."""
    from quarl.quant.experts import _grouped_kernel_applies
    from quarl.quant.kernels.moe_rules import moe_kernel_supports

    x = torch.randn(3, 128).bfloat16()
    with use_backend("triton"):
        for name, sc in SCHEMES.items():
            qw = quantize_weight(torch.randn(2, 128), sc)
            assert _grouped_kernel_applies(x, qw, 1, None, None) == moe_kernel_supports(sc), name
    assert {n for n, s in SCHEMES.items() if moe_kernel_supports(s)} == set(SUPPORTED)


def test_auto_rule_is_rows_per_expert_by_weight_bits(monkeypatch):
    """kernel_wins decides by shapes alone: rows <= the measured average rows per expert
    times the experts, per weight bits; schemes the kernel cannot read never."""
    from quarl.quant.kernels import moe_rules

    monkeypatch.setattr(moe_rules, "KERNEL_MAX_AVG_ROWS", {4: 8.0, 8: 2.0})
    w4, fp8 = get_scheme("w4a16"), get_scheme("w8a8-fp8")
    assert moe_rules.kernel_wins(w4, 1024, 128) and not moe_rules.kernel_wins(w4, 1025, 128)
    assert moe_rules.kernel_wins(fp8, 256, 128) and not moe_rules.kernel_wins(fp8, 257, 128)
    assert not moe_rules.kernel_wins(get_scheme("w2a16"), 1, 128)
    assert not moe_rules.kernel_wins(get_scheme("bf16"), 1, 128)
