"""Every Triton kernel equals its reference (TRITON_INTERPRET=1 on CPU), on odd shapes."""

import pytest
import torch
import torch.nn.functional as F

from quarl.quant import get_scheme, quant_linear, quantize_weight, reference_linear, use_backend
from quarl.quant import reference as ref

pytestmark = pytest.mark.usefixtures("needs_triton")

MS = [1, 17, 33]
N, K = 48, 200  # N not a multiple of the tile, K not a multiple of the 128-column chunk


class _Kernels:
    """The kernel modules under one name (imported lazily: triton)."""

    def __getattr__(self, name):
        from quarl.quant.kernels import act_quant, dispatch, launch, splitk, w8a8, weight_only

        for mod in (launch, weight_only, w8a8, dispatch, splitk, act_quant):
            if hasattr(mod, name):
                return getattr(mod, name)
        raise AttributeError(name)


def _launch():
    return _Kernels()


def _plan(kernel, cfg):
    from quarl.quant.kernels.dispatch import Plan

    return Plan(kernel, cfg)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_act_quant_kernel_matches_reference_codes(act):
    x = torch.randn(17, 300) * torch.logspace(-3, 2, 17)[:, None]
    x[3] = 0
    x[5, 7] = 1e4  # outlier row
    q, s = _launch().act_quant(x, act)
    q_ref, s_ref = ref.quantize_activations(x, act)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_act_dequant_kernel_equals_reference_every_code(act):
    """Codes x per-token scales -> bf16 in one pass: every int8 / e4m3 code (NaN aside) on
    rows of different scales, bit for bit equal to the fp32 reference rounded once."""
    from quarl.quant.kernels.act_quant import act_dequant

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if act == "fp8":
        codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn NaNs
    q = codes.repeat(5, 1)
    q = q.view(torch.float8_e4m3fn) if act == "fp8" else q.view(torch.int8)
    s = torch.tensor([1.0, 3.7e-3, 0.0, 251.3, 1e-6])
    out = act_dequant(q, s, torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.dequantize_activations(q, s, torch.bfloat16).view(torch.int16))


def test_e4m3_byte_equals_torch_cast():
    """The kernel's fp32 -> e4m3 byte conversion equals torch's clamp + cast bit for bit on
    the hard cases (the interpreter's path; tests_gpu checks the hardware conversion)."""
    from quarl.quant.kernels import triton_kernels as tk
    from tests.fp8_cases import e4m3_hard_cases

    v = e4m3_hard_cases()
    q = torch.empty(v.numel(), dtype=torch.uint8)
    tk.e4m3_byte_kernel[(-(-v.numel() // 1024),)](v, q, v.numel(), BLOCK=1024)
    expect = ref.to_e4m3(v).view(torch.uint8)
    bad = q != expect
    assert not bad.any(), (v[bad][:8].tolist(), q[bad][:8].tolist(), expect[bad][:8].tolist())


WO = ["w4a16", "w4a16-asym", "w2a16", "nvfp4", "mxfp4"]


@pytest.mark.parametrize("name", WO)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("post_scale", [True, False])
def test_weight_only_kernel(name, m, split_k, post_scale):
    launch = _launch()
    qw = quantize_weight(torch.randn(N, K), name)
    x, bias = torch.randn(m, K), torch.randn(N)
    cfg = launch.lookup("weight_only", "none", m, N, K).config._replace(split_k=split_k, post_scale=post_scale)
    out = launch.tiled_gemm(x, qw, bias, cfg)
    assert out.shape == (m, N) and out.dtype == x.dtype
    assert _rel(out, reference_linear(x, qw, bias, exact=True)) < 1e-5


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_int8_gemm_kernel(m, split_k):
    launch = _launch()
    qw = quantize_weight(torch.randn(N, K), "w8a8-int8")
    x, bias = torch.randn(m, K), torch.randn(N)
    xq, sx = launch.act_quant(x, "int8")
    cfg = launch.TileConfig(16, 32, 64, split_k=split_k)
    out = launch.pointer_gemm(xq, sx, qw, bias, x.dtype, cfg)
    assert _rel(out, reference_linear(x, qw, bias, exact=True)) < 1e-6


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8"])
def test_w8a8_tma_kernel(m, name):
    """The TMA / persistent W8A8 kernel: zero-filled tiles past M, N and K (N = 72 and K = 272
    are not multiples of the tiles), bias, and fewer programs than tiles (each walks several)."""
    launch = _launch()
    n, k = 72, 272
    qw = quantize_weight(torch.randn(n, k), name)
    x, bias = torch.randn(m, k), torch.randn(n)
    xq, sx = launch.act_quant(x, qw.scheme.act_format)
    expect = reference_linear(x, qw, bias, exact=True)
    tail = [launch.TileConfig(16, bn, 32, split_k=-1, waves=1) for bn in (16, 32)]
    # the tail split runs: tiles of a partial last wave (4 slots on CPU) split, others whole
    works = [launch.tma_split(-(-m // 16) * -(-n // c.bn), 9, 4, -1) for c in tail]
    assert any(w.split > 1 and w.whole > 0 for w in works)
    assert any(w.split > 1 for w in works)
    for cfg in [launch.TileConfig(16, 32, 64), launch.TileConfig(16, 16, 32, group_m=2, waves=0.25),
                launch.TileConfig(16, 32, 32, split_k=3, waves=0.5)] + tail:  # K split in 3: 9 blocks of 32
        out = launch.tma_gemm(xq, sx, qw, bias, x.dtype, cfg)
        assert _rel(out, expect) < 1e-6


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8"])
def test_gated_silu_gemm_and_partials_quantizer(m, name):
    """The gated TMA GEMM on a ``[gate; up]`` weight (I = 40: the last gate tile reads past
    the gate rows; tiles zero-filled past M and K) returns ``silu(g) * u`` and, per tile, the
    rows' max |y|; the partials quantizer gives act_quant's codes of y bit for bit."""
    launch = _launch()
    inter, k = 40, 272
    qw = quantize_weight(torch.randn(2 * inter, k), name)
    x = torch.randn(m, k)
    fmt = qw.scheme.act_format
    xq, sx = launch.act_quant(x, fmt)
    gu = reference_linear(x, qw, exact=True)
    expect = F.silu(gu[:, :inter]) * gu[:, inter:]
    for cfg in (launch.TileConfig(16, 16, 64), launch.TileConfig(16, 32, 32, group_m=2, waves=0.25)):
        y, amax = launch.gated_gemm(xq, sx, qw, x.dtype, cfg)
        assert y.shape == (m, inter) and amax.shape == (m, -(-inter // cfg.bn))
        assert _rel(y, expect) < 1e-5
        assert torch.equal(amax.amax(1), y.abs().amax(1))
        q, s = launch.act_quant_from_partials(y, amax, fmt)
        q_ref, s_ref = launch.act_quant(y, fmt)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.int8), q_ref.view(torch.int8))
    # a batch size the gated tile does not cover (split-K at M <= 16) and an odd row count
    assert launch.gated_silu_gemm(xq[:1], sx[:1], qw, x.dtype) is None
    with pytest.raises(ValueError, match="cannot split K"):
        launch.gated_gemm(xq, sx, qw, x.dtype, launch.TileConfig(16, 16, 64, split_k=2))
    with pytest.raises(ValueError, match="even number of rows"):
        launch.gated_silu_gemm(xq, sx, quantize_weight(torch.randn(7, k), name), x.dtype)


def test_tma_work_items():
    """Tail split: the full waves stay whole, the partial wave's tiles split to fill the slots
    (>= 2 K blocks per split); fixed split; no split."""
    def work(*a):
        return tuple(_launch().tma_split(*a)[:3])

    assert work(288, 28, 132, -1) == (264, 5, 6)  # 7B qkv, M = 1024, 128 x 128: 24 tail tiles x 5
    assert work(56, 28, 132, -1) == (0, 2, 14)  # one partial wave only: every tile split
    assert work(264, 28, 132, -1) == (264, 1, 28)  # full waves: nothing to split
    assert work(224, 28, 132, -1) == (224, 1, 28)  # a tail of 92 tiles: splitting it cannot help
    assert work(5, 3, 8, -1) == (5, 1, 3)  # 3 K blocks: no split leaves >= 2 per part
    assert work(56, 28, 132, 3) == (0, 3, 10) and work(56, 28, 132, 1) == (56, 1, 28)


def test_w8a8_tma_falls_back_on_unaligned_rows():
    """K = 100 rows are not 16-byte aligned (TMA cannot describe them): the pointer kernel runs."""
    launch = _launch()
    qw = quantize_weight(torch.randn(24, 100), "w8a8-int8")
    x = torch.randn(5, 100)
    xq, sx = launch.act_quant(x, "int8")
    out = launch.tma_gemm(xq, sx, qw, None, x.dtype, launch.TileConfig(16, 32, 64))
    assert _rel(out, reference_linear(x, qw, exact=True)) < 1e-6


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("group", [128, 64])
def test_w4a8_kernel(m, split_k, group):
    launch = _launch()
    sc = get_scheme("w4a8-int8").replace(group_size=group)
    qw = quantize_weight(torch.randn(N, K), sc)
    x = torch.randn(m, K)
    xq, sx = launch.act_quant(x, "int8")
    out = launch.w4a8_gemm(xq, sx, qw, None, x.dtype,
                           launch.lookup("w4a8", "none", m, N, K).config._replace(split_k=split_k))
    assert _rel(out, reference_linear(x, qw, exact=True)) < 1e-6


@pytest.mark.parametrize("name",
                         ["w8a8-int8", "w8a8-fp8", "w4a16", "w4a8-int8", "nvfp4", "mxfp4", "w2a16", "w4a16-asym"])
def test_dispatch_forced_triton_matches_reference(name):
    qw = quantize_weight(torch.randn(N, K), name)
    x = torch.randn(2, 5, K)  # leading dims are flattened
    with use_backend("triton"):
        fast = quant_linear(x, qw)
    assert fast.shape == (2, 5, N)
    tol = 1e-5
    assert _rel(fast, reference_linear(x, qw, exact=True)) < tol


@pytest.mark.parametrize("name", WO)
def test_dequant_kernel_exact(name):
    qw = quantize_weight(torch.randn(N, K), name)
    assert torch.equal(_launch().dequantize(qw, torch.float32), qw.dequantize(torch.float32))


def test_split_k_counters_are_reset_and_result_deterministic():
    launch = _launch()
    qw = quantize_weight(torch.randn(N, 640), "w4a16")
    x = torch.randn(3, 640)
    cfg = launch.lookup("weight_only", "none", 3, N, 640).config._replace(split_k=3)
    a = launch.tiled_gemm(x, qw, None, cfg)
    b = launch.tiled_gemm(x, qw, None, cfg)
    assert torch.equal(a, b)
    assert int(launch.COUNTERS.get(x.device, 1).abs().sum()) == 0


# int4 g128 small-M Triton kernel (tensor-core dot with the weights as A)
W4_N, W4_K = 40, 330  # odd N, K % 128 != 0 (3 chunks, last one partial)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 3, 16, 17])
@pytest.mark.parametrize("split_k", [1, 2])
def test_w4_swap_kernel(name, m, split_k):
    launch = _launch()
    qw = quantize_weight(torch.randn(W4_N, W4_K), name)
    x, bias = torch.randn(m, W4_K), torch.randn(W4_N)
    out = launch.swap_gemm(x, qw, bias if split_k == 2 else None, launch.TileConfig(16, 32, split_k=split_k))
    assert out.shape == (m, W4_N)
    expect = reference_linear(x, qw, bias if split_k == 2 else None, exact=True)
    assert _rel(out, expect) < 1e-5


def test_w4_dispatch_off_the_gpu_runs_the_swap_kernel():
    launch = _launch()
    qw = quantize_weight(torch.randn(W4_N, W4_K), "w4a16")
    x = torch.randn(5, W4_K)
    plan = launch.pick(qw, 5, x.device, x.dtype)
    assert plan.kernel == "swap"  # CPU: no CUDA kernel; on a GPU the frag / tile / wgmma rows
    with use_backend("triton"):
        assert _rel(quant_linear(x, qw), reference_linear(x, qw, exact=True)) < 1e-5
        assert torch.equal(quant_linear(x, qw), plan.run(x, qw, None))
    with pytest.raises(ValueError):
        launch.swap_gemm(x, quantize_weight(torch.randn(W4_N, W4_K), "w2a16"), None, launch.TileConfig(16, 32))


@pytest.mark.parametrize("m", [1, 17])
def test_fp8_triton_gemm_kernel(m):
    launch = _launch()
    qw = quantize_weight(torch.randn(N, K), "w8a8-fp8")
    x, bias = torch.randn(m, K), torch.randn(N)
    cfg = launch.TileConfig(16, 32, 64, split_k=2)
    out = launch.pointer_gemm(*launch.act_quant(x, "fp8"), qw, bias, x.dtype, cfg)
    assert _rel(out, reference_linear(x, qw, bias, exact=True)) < 1e-5


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("dtype", [torch.float16])  # the interpreter's bf16 math is broken (GPU suite)
def test_w4_swapb_half_activations_and_waves(name, dtype):
    """SUB16 dequant (16-bit 1024 + code minus the offset for fp16) in the activation dtype,
    with the K split picked by ``waves`` (interpreter: 4 "SMs", so 3 chunks -> 3 splits)."""
    launch = _launch()
    qw = quantize_weight(torch.randn(W4_N, W4_K), name)
    x = torch.randn(16, W4_K).to(dtype)
    bias = torch.randn(W4_N).to(dtype)
    for cfg in (launch.TileConfig(16, 32, waves=8), launch.TileConfig(16, 64, waves=1),
                launch.TileConfig(16, 16, split_k=1), launch.TileConfig(16, 32, split_k=2)):
        out = launch.swap_gemm(x, qw, bias, cfg)
        expect = reference_linear(x.float(), qw, bias.float(), exact=True)
        assert out.dtype == dtype
        assert _rel(out, expect) < 4e-3  # output rounding to 16 bits only


def test_act_quant_two_pass_long_rows():
    launch = _launch()
    x = torch.randn(3, 200) * 3
    q, s = launch.act_quant(x, "int8")  # interpreter: 64-column blocks, so 4 blocks per row
    q_ref, s_ref = ref.quantize_activations(x, "int8")
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("k", [40, 160])  # one pass and two passes (block 64 under the interpreter)
def test_act_quant_writes_the_dequantized_codes_of_act_dequant(act, k):
    """The quantizer's optional second output is, bit for bit, what the dequantizer makes of
    its codes (the aligned W8A8 backward's x as the GEMM saw it), and the codes and scales
    are those of the plain call."""
    from quarl.quant.kernels.act_quant import act_quant

    x = (torch.randn(9, k) * torch.logspace(-3, 2, 9)[:, None]).to(torch.bfloat16)
    q, s, dq = act_quant(x, act, dequantized=torch.bfloat16)
    q0, s0 = act_quant(x, act)
    assert torch.equal(q.view(torch.uint8) if act == "fp8" else q, q0.view(torch.uint8) if act == "fp8" else q0)
    assert torch.equal(s, s0)
    want = ref.dequantize_activations(q, s, torch.bfloat16)
    assert dq.dtype == torch.bfloat16 and torch.equal(dq.view(torch.int16), want.view(torch.int16))
