"""GPU suite (not run in CI): every fast path against its reference on fresh random inputs.

    PYTHONPATH=. python3 -m pytest tests_gpu/quant -q
"""

import pytest
import torch

from quarl.quant import (
    QATLinear,
    QuantLinear,
    get_scheme,
    quant_linear,
    quantize_weight,
    reference_linear,
    use_backend,
)
from quarl.quant import reference as ref


FORMATS = ["w8a8-int8", "w8a8-fp8", "w4a16", "w4a16-asym", "w4a8-int8", "nvfp4", "mxfp4", "w2a16"]
MS = [1, 16, 33, 200, 1100]
SHAPES = [(512, 1536), (1000, 1040)]  # 1040: K % 128 != 0


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _w4_case(n: int, k: int, m: int, name: str):
    """A random ``[n, k]`` weight of scheme ``name``, bf16 input ``[m, k]`` and bias, and the
    exact reference output (the w4 CUDA kernel tests)."""
    qw = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, name)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return qw, x, bias, reference_linear(x.float(), qw, bias.float(), exact=True)


def _check_block_config(gemm, cfg, x, qw, bias, expect, frag):
    """One block-kernel config (tile / wgmma): deterministic, equal to the float64
    reference and, at M <= 16, to the fragment kernel. Returns the output."""
    a = gemm(x, qw, bias, cfg)
    b = gemm(x, qw, bias, cfg)
    assert torch.equal(a, b), cfg
    _check(a, expect, 5e-3)
    if frag is not None:
        _check(a, frag.float(), 5e-3)
    return a


def _check(out, expect, tol):
    assert out.isfinite().all()
    assert _rel(out, expect) < tol, _rel(out, expect)


@pytest.mark.parametrize(
    "act",
    ["int8", "fp8"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_codes_equal_reference(act, dtype):
    from quarl.quant.kernels import launch

    x = (torch.randn(300, 5000, device="cuda") * torch.logspace(-4, 3, 300, device="cuda")[:, None]).to(dtype)
    x[7] = 0
    q, s = launch.act_quant(x, act)
    q_ref, s_ref = ref.quantize_activations(x, act)
    assert torch.equal(s, s_ref)
    bad = q.view(torch.int8) != q_ref.view(torch.int8)
    if bad.any():
        v = (x.float() / s[:, None])[bad][:8].tolist()
        pytest.fail(f"{int(bad.sum())} codes differ; x/s={v} kernel={q.float()[bad][:8].tolist()} torch={q_ref.float()[bad][:8].tolist()}")


@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_act_dequant_equals_reference(act):
    """The learner's grad_W input: codes x per-token scales, rounded once to bf16 on the GPU
    (hardware round-to-nearest-even), bit for bit the reference."""
    from quarl.quant import ops

    x = torch.randn(300, 5000, device="cuda") * torch.logspace(-4, 3, 300, device="cuda")[:, None]
    q, s = ref.quantize_activations(x, act)
    out = ops.dequantize_activations(q, s, torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.dequantize_activations(q, s, torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("act", ["int8", "fp8"])
@pytest.mark.parametrize("k", [768, 896, 1536, 8960])  # one pass (1024- and 2048-column blocks); two passes
def test_act_quant_dequantized_output_equals_reference(act, k):
    """The aligned W8A8 forward's second quantizer output (x as the GEMM saw it, kept for
    grad_W) on the GPU: bit for bit the reference's dequantized codes; codes and scales those
    of the plain call and of the reference. (At K = 768 ptxas once miscompiled the fp8 codes
    of every odd column when the kernel also wrote x as seen.)"""
    from quarl.quant import ops

    x = (torch.randn(300, k, device="cuda") * torch.logspace(-4, 3, 300, device="cuda")[:, None]).to(torch.bfloat16)
    q, s, dq = ops.quantize_input(x, act, torch.bfloat16)
    q0, s0 = ops.quantize_input(x, act)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    q_ref, s_ref = ref.quantize_activations(x, act)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(dq.view(torch.int16), ref.dequantize_activations(q, s, torch.bfloat16).view(torch.int16))


def test_e4m3_hardware_conversion_equals_torch_cast():
    """The GPU quantizers' e4m3 codes come from the hardware conversion: bit for bit torch's
    clamp + cast on every e4m3 value, midpoint, subnormal, saturation, inf and NaN."""
    from quarl.quant.kernels import triton_kernels as tk
    from tests.fp8_cases import e4m3_hard_cases

    assert tk.HW_E4M3
    v = e4m3_hard_cases("cuda")
    q = torch.empty(v.numel(), dtype=torch.uint8, device="cuda")
    tk.e4m3_byte_kernel[(-(-v.numel() // 1024),)](v, q, v.numel(), BLOCK=1024)
    expect = ref.to_e4m3(v).view(torch.uint8)
    bad = q != expect
    assert not bad.any(), (v[bad][:8].tolist(), q[bad][:8].tolist(), expect[bad][:8].tolist())


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_fast_path_matches_reference(name, shape, m):
    n, k = shape
    w = torch.randn(n, k, device="cuda") * 0.02
    qw = quantize_weight(w, name)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = quant_linear(x, qw, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # bf16 output rounding (~2e-3) + bf16 weight tiles + fp32 accumulation order
    _check(out, reference_linear(x.float(), qw, bias.float(), exact=True), 1.5e-2)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "w2a16", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_weight_only_configs_and_determinism(name, m):
    from quarl.quant.kernels import dispatch, weight_only
    from quarl.quant.kernels.config import TileConfig

    n, k = 3584, 3584
    qw = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, name)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expect = reference_linear(x.float(), qw, exact=True)
    tiled = dispatch.lookup("weight_only", "none", min(m, 127), n, k).config
    runs = [(weight_only.tiled_gemm, c) for c in (tiled, TileConfig(16, 64, split_k=4), TileConfig(64, 128, split_k=1, post_scale=False))]
    if name.startswith("w4a16") and m <= 64:  # the int4 g128 swap kernel, K split by waves
        bm = 16 if m <= 16 else 64
        runs += [(weight_only.swap_gemm, TileConfig(bm, bn, waves=w)) for bn, w in ((64, 4), (128, 1), (32, 8))]
        runs += [(weight_only.swap_gemm, TileConfig(bm, 64, waves=8, num_stages=1))]
    for gemm, cfg in runs:
        a = gemm(x, qw, None, cfg)
        b = gemm(x, qw, None, cfg)
        assert torch.equal(a, b)  # no atomics: bitwise deterministic
        _check(a, expect, 1.5e-2)


@pytest.mark.parametrize("m", [1, 16, 256, 2048])
@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8"])
def test_w8a8_gemm_configs(m, name):
    """Pointer and TMA kernels (int8 and e4m3), N = 4000 not a multiple of any tile, with
    bias; the TMA kernel's persistent walk (fewer programs than tiles) included."""
    from quarl.quant.kernels import dispatch, launch, w8a8
    from quarl.quant.kernels.config import TileConfig

    n, k = 4000, 3584
    qw = quantize_weight(torch.randn(n, k, device="cuda"), name)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, sx = launch.act_quant(x, qw.scheme.act_format)
    expect = reference_linear(x.float(), qw, bias.float(), exact=True)
    plans = [dispatch.lookup("int8", "none", m, n, k), dispatch.Plan("pointer", TileConfig(128, 128, 64, split_k=1)),
             dispatch.Plan("pointer", TileConfig(16, 64, 256, split_k=3))]
    plans += [dispatch.Plan("tma", TileConfig(bm, bn, bk, num_warps=w, num_stages=st, waves=wv))
              for bm, bn, bk, w, st, wv in ((128, 128, 128, 8, 4, 1), (64, 128, 128, 4, 4, 2), (128, 256, 128, 8, 3, 0.25))]
    plans += [dispatch.Plan("tma", TileConfig(128, 128, 128, split_k=sp, num_warps=8, num_stages=4, waves=wv)) for sp, wv in ((3, 1), (4, 0.5))]
    # tail split (M = 2048 on 39 slots: 507 tiles whole, 5 split in 7); the int8 table's large-M tiles
    plans += [dispatch.Plan("tma", TileConfig(128, 128, 128, split_k=-1, num_warps=8, num_stages=4, waves=0.3)),
              dispatch.lookup("int8", "none", 4096, 4096, 12288), dispatch.lookup("int8", "none", 4096, 37888, 3584)]
    for plan in plans:
        if plan.kernel == "cublas":
            continue
        gemm = w8a8.pointer_gemm if plan.kernel == "pointer" else w8a8.tma_gemm
        out = gemm(xq, sx, qw, bias, torch.bfloat16, plan.config)
        _check(out, expect, 1e-2)
        assert torch.equal(out, gemm(xq, sx, qw, bias, torch.bfloat16, plan.config))


@pytest.mark.parametrize("name", FORMATS)
def test_qat_forward_equals_quantlinear_on_gpu(name):
    """At a decode-sized M the aligned forward of a scheme that quantizes activations is the
    engine's kernel bit for bit; a weight-only scheme's is ``F.linear`` over the dequantized
    weight (the learner's path at every M), within summation order of the engine's kernel."""
    lin = torch.nn.Linear(1536, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    qat = QATLinear.from_linear(lin, name)
    inf = QuantLinear.from_linear(lin, name)
    x = torch.randn(4, 9, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = qat(x)
    sc = qat.scheme
    if sc.act_format == "none":
        w = quantize_weight(lin.weight.detach(), sc).dequantize(torch.bfloat16)
        assert torch.equal(y, torch.nn.functional.linear(x.detach(), w, lin.bias.detach()))
        assert _rel(y, inf(x.detach())) < 1e-2
    else:
        assert torch.equal(y, inf(x.detach()))
    y.float().square().sum().backward()
    assert x.grad.isfinite().all() and lin.weight.grad.isfinite().all()


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "mxfp4"])
def test_qat_leaf_path_at_training_m_equals_the_engine_and_the_ste_reference(name):
    """At learner batch sizes (M > 128) the aligned weight-only forward is F.linear on the
    dequantized leaf: bit-equal to the engine's QuantLinear (its dequant plan), and the master
    weight's gradient, moved by the hook, is grad_y^T x over two micro-batches."""
    lin = torch.nn.Linear(1536, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    qat = QATLinear.from_linear(lin, name)
    inf = QuantLinear.from_linear(lin, name)
    xs = [torch.randn(3, 300, 1536, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    gys = [torch.randn(3, 300, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    for x, gy in zip(xs, gys):
        y = qat(x)
        assert "QATMatmul" not in type(y.grad_fn).__name__
        assert torch.equal(y, inf(x))
        y.backward(gy)
    want = sum(g.reshape(-1, 512).float().T @ x.reshape(-1, 1536).float() for g, x in zip(gys, xs))
    assert _rel(lin.weight.grad.float(), want) < 1e-2 and qat._leaf.leaf.grad is None


@pytest.mark.parametrize("name", ["w4a16", "w8a8-fp8", "w8a8-int8"])
def test_qat_group_on_gpu_matches_members_one_by_one(name):
    """The learner's grouped q/k/v GEMM on the GPU: outputs and every master weight's
    gradient as the members give them one by one (up to the GEMMs' summation order)."""
    from quarl.quant.linear import QATGroup

    lins = [torch.nn.Linear(1536, n, bias=True, device="cuda", dtype=torch.bfloat16) for n in (1536, 256, 256)]
    mods = [QATLinear.from_linear(lin, name) for lin in lins]
    group = QATGroup(mods)
    x = torch.randn(2, 400, 1536, device="cuda", dtype=torch.bfloat16)
    gys = [torch.randn(2, 400, m.out_features, device="cuda", dtype=torch.bfloat16) for m in mods]
    outs = group(x)
    sum((o.float() * g.float()).sum() for o, g in zip(outs, gys)).backward()
    fused = [lin.weight.grad.clone() for lin in lins]
    for lin in lins:
        lin.weight.grad = None
    sep = [m(x) for m in mods]
    sum((o.float() * g.float()).sum() for o, g in zip(sep, gys)).backward()
    for a, b in zip(outs, sep):
        assert _rel(a, b) < 1e-2
    for a, lin in zip(fused, lins):
        assert _rel(a, lin.weight.grad) < 1e-2


@pytest.mark.parametrize("name", ["w4a16", "w8a8-int8", "w8a8-fp8", "nvfp4"])
def test_quantlinear_cuda_graph_sees_loaded_weights(name):
    a = torch.nn.Linear(1536, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.nn.Linear(1536, 512, device="cuda", dtype=torch.bfloat16)
    inf = QuantLinear.from_linear(a, name)
    x = torch.randn(8, 1536, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        inf(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = inf(x)
    inf.load_quantized(quantize_weight(b.weight, name))
    inf.bias.data.copy_(b.bias)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, QuantLinear.from_linear(b, name)(x))


def test_reference_backend_on_gpu_matches_fast_path_closely():
    qw = quantize_weight(torch.randn(512, 1536, device="cuda"), get_scheme("w4a16"))
    x = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    with use_backend("reference"):
        slow = quant_linear(x, qw)
    _check(quant_linear(x, qw), slow.float(), 1.5e-2)


def test_split_k_counters_survive_graph_capture_order():
    """Two graphs with split-K GEMMs: replaying the one captured second first must still be
    correct (counters are zeroed eagerly, not by whichever graph captured their fill)."""
    import torch

    from quarl.quant import get_scheme, quant_linear, quantize_weight
    from quarl.quant.kernels.w4_layout import RepackCache

    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(256, 768, device="cuda", dtype=torch.bfloat16) * 0.02, get_scheme("w4a16"))
    repacked = RepackCache()  # the weight owner's kernel layouts (QuantLinear keeps one)
    xs = {m: torch.randn(m, 768, device="cuda", dtype=torch.bfloat16) for m in (64, 8)}
    want = {m: quant_linear(x, qw, None, repacked).float() for m, x in xs.items()}
    graphs, outs = {}, {}
    for m in (64, 8):
        quant_linear(xs[m], qw, None, repacked)  # eager warm-up, as the engine does
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs[m] = quant_linear(xs[m], qw, None, repacked)
        graphs[m] = g
    for m in (8, 64, 8):
        graphs[m].replay()
        torch.cuda.synchronize()
        assert torch.isfinite(outs[m]).all()
        torch.testing.assert_close(outs[m].float(), want[m], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 7, 9, 16])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (512, 18944)])
def test_frag_kernel_configs_match_reference_and_triton(name, m, shape):
    """The CUDA fragment kernel at every warp count and K split (with and without the
    split-K reduction), N not a multiple of 64, odd K; bitwise deterministic."""
    from quarl.quant.kernels import cuda_w4, weight_only
    from quarl.quant.kernels.config import FragConfig, TileConfig
    from quarl.quant.kernels.device import nvrtc_available

    assert nvrtc_available()
    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    swapb = weight_only.swap_gemm(x, qw, bias, TileConfig(16, 64, waves=4))
    for nw, st in ((1, 8), (2, 2), (2, 8), (4, 8), (8, 4)):
        for bps in (0.5, 4, 16):
            cfg = FragConfig(nw=nw, blocks_per_sm=bps, stages=st)
            a = cuda_w4.frag_gemm(x, qw, bias, cfg)
            b = cuda_w4.frag_gemm(x, qw, bias, cfg)
            assert torch.equal(a, b)
            _check(a, expect, 5e-3)
            # same math as the Triton small-M kernel: only the fp32 summation order differs
            _check(a, swapb.float(), 5e-3)


def test_frag_kernel_is_the_default_at_small_m_before_hopper_and_follows_in_place_loads():
    from quarl.quant.kernels import cuda_w4, dispatch
    from quarl.quant.kernels.config import FragConfig

    qw0 = quantize_weight(torch.randn(4096, 4096, device="cuda") * 0.02, "w4a16")
    small = "wgmma" if cuda_w4.wgmma_available() else "frag"  # Hopper: the wgmma kernel at every M <= 64
    assert dispatch.pick(qw0, 4, torch.device("cuda")).kernel == small
    assert dispatch.pick(qw0, 5, torch.device("cuda")).kernel != "frag"
    a, b = (torch.nn.Linear(1040, 700, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    inf = QuantLinear.from_linear(a, "w4a16-asym")
    x = torch.randn(3, 1040, device="cuda", dtype=torch.bfloat16)
    with dispatch.overrides(w4a16=dispatch.Plan("frag", FragConfig(nw=4, blocks_per_sm=4.0, stages=8))):
        inf(x)
        frag = inf.repacked.get(inf.qweight, "frag")
        inf.load_quantized(quantize_weight(b.weight, "w4a16-asym"))
        assert inf.repacked.is_fresh(inf.qweight)
        assert inf.repacked.get(inf.qweight, "frag").qdata.data_ptr() == frag.qdata.data_ptr()
        inf.bias.data.copy_(b.bias)
        expect = reference_linear(x.float(), quantize_weight(b.weight, "w4a16-asym"), b.bias.float(), exact=True)
        _check(inf(x), expect, 5e-3)


TILE_CONFIGS = [
    # (sw, nt, mt, wm, stages): every warp layout the dispatch or the sweep uses
    (4, 4, 1, 1, 4), (4, 8, 1, 1, 4), (2, 8, 1, 1, 3), (4, 4, 2, 1, 4), (4, 4, 2, 1, 3), (2, 4, 2, 2, 6),
    (4, 4, 4, 1, 5), (2, 4, 4, 1, 4), (1, 2, 4, 1, 2), (3, 8, 2, 2, 2),
]


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (704, 18944)])
def test_tile_kernel_configs_match_reference(name, m, shape):
    """The block-tiled CUDA w4 kernel at every block shape that covers M, with and without
    the split-K reduction, N not a multiple of 64 (nor of the block's columns), odd K:
    equal to the float64 reference, to the fragment kernel at M <= 16, and deterministic."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import TileKConfig

    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    frag = cuda_w4.frag_gemm(x, qw, bias) if m <= 16 else None
    ran = 0
    for sw, nt, mt, wm, st in TILE_CONFIGS:
        for bps in (0.25, 2, 8):
            cfg = TileKConfig(sw, nt, mt, wm, st, bps)
            if cfg.rows < m:
                continue
            _check_block_config(cuda_w4.tile_gemm, cfg, x, qw, bias, expect, frag)
            ran += 1
    assert ran >= 6


def test_tile_kernel_runs_where_it_is_the_default_before_hopper():
    """Big weights at 4 < M <= 8: the tile kernel on sm80 / sm89, the wgmma kernel on
    Hopper; the tile kernel (forced) equals the reference either way."""
    from quarl.quant.kernels import cuda_w4, dispatch

    qw = quantize_weight(torch.randn(4096, 12288, device="cuda") * 0.02, "w4a16-asym")
    x = torch.randn(8, 12288, device="cuda", dtype=torch.bfloat16)
    expect = dispatch.pick(qw, 8, x.device).kernel
    assert expect == ("wgmma" if torch.cuda.get_device_capability() == (9, 0) else "tile")
    _check(quant_linear(x, qw), reference_linear(x.float(), qw, exact=True), 5e-3)
    tile = cuda_w4.tile_gemm(x, qw, None, dispatch.lookup("w4a16", "sm80", 8, 4096, 12288).config)
    _check(tile, reference_linear(x.float(), qw, exact=True), 5e-3)


def test_tile_kernel_rejects_what_it_cannot_run():
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import TileKConfig

    qw = quantize_weight(torch.randn(256, 256, device="cuda") * 0.02, "w4a16")
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="covers 32 rows"):
        cuda_w4.tile_gemm(x, qw, None, TileKConfig(2, 4, 2, 1, 3))
    with pytest.raises(ValueError, match="shared memory"):
        cuda_w4.tile_gemm(x, qw, None, TileKConfig(16, 8, 4, 1, 8))


# (nwg, stages, single, minb, tail): double-buffered folds, single-tile ones at up to 4 blocks
# per SM, and the last-wave K split (0.3 x 132 slots on 56 column blocks: 40 whole, 16 split)
WGMMA_CONFIGS = [(1, 3, False, 1, False), (1, 4, False, 1, False), (2, 4, False, 1, False), (2, 6, False, 1, False),
                 (3, 3, False, 1, False), (1, 3, True, 4, False), (2, 4, True, 2, False), (4, 4, True, 1, False),
                 (1, 3, True, 4, True), (2, 3, True, 2, True), (3, 4, True, 1, True)]


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (704, 18944)])
def test_wgmma_kernel_configs_match_reference(name, m, shape):
    """The wgmma w4 kernel (Hopper) at several block shapes, with and without the split-K
    reduction, every wgmma N it compiles (M padded to 8 / 16 / 32 / 64), N not a multiple
    of 64 nor of the block's columns, odd K: equal to the float64 reference, to the
    fragment kernel at M <= 16, and deterministic."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    assert cuda_w4.wgmma_available()
    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    frag = cuda_w4.frag_gemm(x, qw, bias) if m <= 16 else None
    for nwg, st, single, minb, tail in WGMMA_CONFIGS:
        for bps in (0.3, 0.1, 2) if tail else (0.25, 2, 8):
            cfg = WgConfig(nwg, st, bps, single, minb, tail)
            _check_block_config(cuda_w4.wgmma_gemm, cfg, x, qw, bias, expect, frag)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 9, 17, 33, 64])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (704, 18944), (4608, 3584), (518, 896)])
def test_wgmma_cluster_split_equals_global_split(name, m, shape):
    """K splits summed through distributed shared memory (clusters of 2-8 blocks; more
    splits asked are capped at 8; N % 4 != 0: the scalar stores): deterministic, equal to the
    float64 reference and, where the split is the one the global-partials kernel takes, equal
    to it bit for bit."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.kernels.device import num_sms

    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    groups = -(-k // 128)
    for nwg, st, single, minb, tail in ((1, 4, False, 1, False), (1, 3, True, 4, True), (2, 3, True, 2, True),
                                        (3, 4, True, 1, True)):
        for bps in (0.5, 2, 4, 16):
            cfg = WgConfig(nwg, st, bps, single, minb, tail, cluster=True)
            a = _check_block_config(cuda_w4.wgmma_gemm, cfg, x, qw, bias, expect, None)
            cols = -(-(-(-n // 64)) // nwg)
            plan = cuda_w4._blocked_split(cols, groups, num_sms(x.device), bps, tail, True)
            if cuda_w4._blocked_split(cols, groups, num_sms(x.device), bps, tail, False)[:3] == plan[:3]:
                b = cuda_w4.wgmma_gemm(x, qw, bias, cfg._replace(cluster=False))
                assert torch.equal(a, b), (cfg, plan)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [65, 100, 128])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (704, 18944), (17920, 1536)])
def test_wgmma_128_token_tiles(name, m, shape):
    """M = 65-128 in one 128-token tile (single-tile loop; 1-3 warpgroups, K split through
    global partials or a cluster): deterministic, equal to the float64 reference, and without
    a K split equal bit for bit to the same block shape run on 64-row chunks (the numerics of
    the 64-token kernel)."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    for nwg, st, minb in ((1, 3, 2), (2, 3, 1), (2, 4, 1), (3, 3, 1)):
        for bps, cluster in ((0.3, False), (2, False), (2, True), (4, True)):
            _check_block_config(cuda_w4.wgmma_gemm, WgConfig(nwg, st, bps, True, minb, True, cluster), x, qw, bias,
                                expect, None)
        whole = WgConfig(nwg, st, 1e-3, True, minb, False, False)  # one block per column block: no K split
        chunks = torch.cat([cuda_w4.wgmma_gemm(x[i:i + 64], qw, bias, whole) for i in range(0, m, 64)])
        assert torch.equal(cuda_w4.wgmma_gemm(x, qw, bias, whole), chunks), (nwg, st)
    with pytest.raises(ValueError, match="single=True"):
        cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(1, 3, 1.0, False))


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 17, 64, 100])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (704, 18944), (5120, 27648)])
def test_wgmma_mbarrier_loop_equals_the_barrier_loop(name, m, shape):
    """``mbar``: the single-tile loop with per-slot mbarriers (no block barrier per group) gives
    the barrier loop's output bit for bit (same products, same order) at several block shapes,
    ring depths, K splits (global partials and clusters) and 64/128-token tiles; deterministic."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    for cfg in (WgConfig(3, 4, 1.0, True, 1, True), WgConfig(3, 5, 1.0, True, 1, True, True),
                WgConfig(2, 4, 2.0, True, 1, True, True), WgConfig(1, 6, 0.3, True, 2, True),
                WgConfig(2, 4, 1e-3, True, 1, False)):
        if cfg.smem_bytes(cuda_w4.wgmma_tokens(m)) > 227 * 1024:
            continue
        plain = cuda_w4.wgmma_gemm(x, qw, bias, cfg)
        a = _check_block_config(cuda_w4.wgmma_gemm, cfg._replace(mbar=True), x, qw, bias, expect, None)
        assert torch.equal(a, plain), cfg
    with pytest.raises(ValueError, match="mbar=True"):
        cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(2, 4, 1.0, False, mbar=True))


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 17, 64, 100])
@pytest.mark.parametrize("shape", [(3584, 3584), (1000, 1041), (17920, 1536), (1536, 8960)])
def test_wgmma_tma_loop_equals_the_mbarrier_loop(name, m, shape):
    """``tma``: the mbarrier loop fed by the bulk-copy engine (the activation tile from a tensor
    map, rows past M and columns past K zero-filled by it; each slab's words in one copy) gives
    the cp.async loop's output bit for bit at 1-4 warpgroups, K split through global partials
    and clusters, 64/128-token tiles, N and K not multiples of the block, and activation rows
    with a stride wider than K; deterministic and equal to the float64 reference."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    n, k = shape
    qw, x, bias, expect = _w4_case(n, k, m, name)
    wide = torch.randn(m, k + 24, device="cuda", dtype=torch.bfloat16)
    wide[:, :k] = x
    ran = 0
    for cfg in (WgConfig(3, 5, 1.0, True, 1, True, mbar=True), WgConfig(2, 4, 2.0, True, 2, True, True, mbar=True),
                WgConfig(1, 6, 0.3, True, 2, True, mbar=True), WgConfig(2, 4, 1e-3, True, 1, False, mbar=True),
                WgConfig(4, 4, 1.0, True, 1, True, mbar=True)):
        if cfg.smem_bytes(cuda_w4.wgmma_tokens(m)) > 227 * 1024:
            continue
        plain = cuda_w4.wgmma_gemm(x, qw, bias, cfg)
        a = _check_block_config(cuda_w4.wgmma_gemm, cfg._replace(tma=True), x, qw, bias, expect, None)
        assert torch.equal(a, plain), cfg
        assert torch.equal(cuda_w4.wgmma_gemm(wide[:, :k], qw, bias, cfg._replace(tma=True)), plain), cfg
        ran += 1
    assert ran >= 4
    with pytest.raises(ValueError, match="tma=True"):
        cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(2, 4, 1.0, True, tma=True))


def test_wgmma_kernel_is_the_default_up_to_m_128_and_follows_loads():
    from quarl.quant.kernels import dispatch
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.kernels.device import gpu_gen

    gen = gpu_gen(torch.device("cuda"))
    assert gen == "sm90"

    def pick(m, n, k):
        return dispatch.lookup("w4a16", gen, m, n, k)

    for m in (1, 8, 16, 33, 64):
        assert pick(m, 37888, 3584).kernel == "wgmma"
        assert pick(m, 3584, 18944).kernel == "wgmma"
    for m in (1, 4, 64):  # small weights and k/v too (K splits summed in a cluster)
        for n in (3584, 512):
            assert pick(m, n, 3584).kernel == "wgmma"
    assert pick(65, 3584, 3584).config.single and pick(128, 37888, 3584).config.prescale  # 128-token tiles
    assert pick(129, 3584, 3584).config.prescale and pick(513, 3584, 3584).kernel == "dequant"
    # the block shapes: clusters where every column block is split, 2 warpgroups on long K,
    # 3 on the widest weights at M > 32
    assert pick(1, 3584, 3584).config == WgConfig(1, 4, 2.0, False, 1, True, True)
    assert pick(16, 18944, 3584).config.cluster and not pick(32, 18944, 3584).config.cluster
    assert pick(32, 37888, 3584).config == WgConfig(1, 3, 4.0, True, 4, True)
    assert [pick(64, n, k).config.nwg for n, k in ((37888, 3584), (3584, 18944), (3584, 3584))] == [3, 1, 1]
    assert pick(64, 3584, 18944).config.tma and not pick(32, 3584, 18944).config.tma  # the TMA loop at 33-64 rows
    a, b = (torch.nn.Linear(4096, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    inf = QuantLinear.from_linear(a, "w4a16")
    x = torch.randn(12, 4096, device="cuda", dtype=torch.bfloat16)
    _check(inf(x), reference_linear(x.float(), quantize_weight(a.weight, "w4a16"), a.bias.float(), exact=True), 5e-3)
    words = inf.repacked.get(inf.qweight, "wgmma")
    inf.load_quantized(quantize_weight(b.weight, "w4a16"))
    inf.bias.data.copy_(b.bias)
    assert inf.repacked.is_fresh(inf.qweight)
    assert inf.repacked.get(inf.qweight, "wgmma").qdata.data_ptr() == words.qdata.data_ptr()
    _check(inf(x), reference_linear(x.float(), quantize_weight(b.weight, "w4a16"), b.bias.float(), exact=True), 5e-3)


def test_wgmma_kernel_rejects_what_it_cannot_run():
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    qw = quantize_weight(torch.randn(256, 256, device="cuda") * 0.02, "w4a16")
    with pytest.raises(ValueError, match="M <= 128"):
        cuda_w4.wgmma_gemm(torch.randn(129, 256, device="cuda", dtype=torch.bfloat16), qw, None)
    with pytest.raises(ValueError, match="needs single=True"):
        cuda_w4.wgmma_gemm(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), qw, None, WgConfig(2, 4))
    with pytest.raises(ValueError, match=">= 3 stages"):
        cuda_w4.wgmma_gemm(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16), qw, None, WgConfig(1, 2))
    with pytest.raises(ValueError, match="shared memory"):
        cuda_w4.wgmma_gemm(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16), qw, None, WgConfig(4, 8))
    with pytest.raises(ValueError, match="minb x nwg"):
        cuda_w4.wgmma_gemm(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16), qw, None, WgConfig(4, 3, 1.0, True, 5))


def _lora_case(n_members, ranks, k, m, starts=None):
    """Adapters of a fused group (block-diagonal B over members of the given row counts, the
    last member without an adapter) as a LoRATerm on random rows."""
    from quarl.quant.ops import LoRATerm

    n, r = sum(n_members), sum(ranks)
    b = torch.zeros(n, r, device="cuda", dtype=torch.bfloat16)
    row, col, starts_, cols = 0, 0, [], []
    for i, (rows, rank) in enumerate(zip(n_members, ranks)):
        starts_.append(row)
        cols.append(col)
        if i < len(n_members) - 1 or len(n_members) == 1:
            b[row:row + rows, col:col + rank] = torch.randn(rows, rank, device="cuda") * 0.05
        row, col = row + rows, col + rank
    xa = torch.randn(m, r, device="cuda", dtype=torch.bfloat16)
    starts_[0] = 0
    return LoRATerm(xa, b, 1.5, max(ranks), tuple(starts_), tuple(cols))


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [9, 16, 33, 64, 100, 128])
def test_wgmma_adds_a_lora_term_in_its_epilogue(name, m):
    """The wgmma kernel with a LoRA term (ranks 8-128, one to three members, K splits through
    global partials and clusters) equals the kernel without it plus the term summed per member
    in float64, to the bf16 rounding of the two outputs; deterministic."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    torch.manual_seed(m)
    k = 1536
    layouts = [((768,), (8,)), ((512, 128, 128), (64, 64, 64)), ((512, 256), (128, 128)), ((384, 640), (24, 40))]
    for members, ranks in layouts:
        n = sum(members)
        qw, x, bias, _ = _w4_case(n, k, m, name)
        term = _lora_case(members, ranks, k, m)
        width = 64 if term.rank <= 64 else 128
        extra = ref.lora_term_by_member(term.xa, term.b, term.scaling, term.starts, term.cols, width)
        ran = 0
        for cfg in (WgConfig(3, 5, 1.0, True, 1, True, mbar=True), WgConfig(2, 3, 2.0, True, 2, True, True),
                    WgConfig(1, 4, 2.0, tail=True, cluster=True), WgConfig(1, 3, 4.0, True, 4, True),
                    WgConfig(2, 4, 1e-3, True, 1, False), WgConfig(2, 3, 1.0, True, 1, True, True)):
            if cfg.smem_bytes(cuda_w4.wgmma_tokens(m)) > 227 * 1024 or (m > 64 and not cfg.single):
                continue
            if not cuda_w4.takes_lora(cfg, x, term):
                continue
            plain = cuda_w4.wgmma_gemm(x, qw, bias, cfg)
            got = cuda_w4.wgmma_gemm(x, qw, bias, cfg, lora=term)
            assert torch.equal(got, cuda_w4.wgmma_gemm(x, qw, bias, cfg, lora=term)), cfg
            want = plain.double() + extra
            err = (got.double() - want).abs()
            assert (err <= 2 ** -7 * (want.abs() + plain.double().abs()) + 1e-3).all(), (cfg, members, float(err.max()))
            assert (got.double() - plain.double()).abs().max() > 1e-2  # the term is there
            ran += 1
        assert ran >= 2, (members, ranks)


def test_engine_lora_shapes_of_7b_take_the_fused_epilogue():
    """At decode batch 64 every adapted 7B projection's default plan adds its rank-64 adapters in
    the w4a16 kernel (no fallback to a separate addmm; a TMA-loop plan as its mbarrier loop,
    which takes the term), and gives the addmm's result."""
    from quarl.quant.kernels import cuda_w4, dispatch, launch

    for members, k in (((3584, 512, 512), 3584), ((3584,), 3584), ((18944, 18944), 3584), ((3584,), 18944)):
        n = sum(members)
        qw, x, _, _ = _w4_case(n, k, 64, "w4a16")
        term = _lora_case(members, (64,) * len(members), k, 64)
        plan = dispatch.pick(qw, 64, x.device)
        assert plan.kernel == "wgmma" and cuda_w4.takes_lora(plan.config._replace(tma=False), x, term), (members, k, plan)
        assert not cuda_w4.takes_lora(plan.config._replace(tma=True), x, term)
        got = launch.linear(x, qw, None, None, term)
        plain = launch.linear(x, qw, None)
        want = term.add_to(plain).double()  # (rounded twice: the base, then the sum)
        err = (got.double() - want).abs()
        assert (err <= 2 ** -7 * (want.abs() + plain.double().abs()) + 1e-3).all(), (members, float(err.max()))


@pytest.mark.parametrize("m", [8, 40, 64, 100])
def test_w4_cuda_kernels_as_dependent_launches_give_the_same_bits(m):
    """The fragment, tile and wgmma kernels (global and cluster K splits, the pre-scaled loop
    with a producer warpgroup) launched through
    ``cuLaunchKernelEx`` as programmatic dependent launches, back to back eagerly and inside
    a CUDA graph: the same output bits as plain launches."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import FragConfig, TileKConfig, WgConfig
    from quarl.quant.kernels.device import dependent, dependent_launches
    from quarl.quant.kernels.w4_layout import RepackCache

    qw, x, bias, expect = _w4_case(1536, 8960, m, "w4a16")
    rc = RepackCache()  # the layouts made by the plain runs, before the capture
    runs = [lambda: cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(1, 4, 2, True, 1, True, cluster=False), rc),
            lambda: cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(2, 3, 2, True, 2, True, cluster=True), rc),
            lambda: cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(1, 4, 2, True, 2, True, True, mbar=True, tma=True), rc),
            lambda: cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(2, 4, 1.0, tail=True, prescale=True, tma=True, producer=True), rc),
            lambda: cuda_w4.wgmma_gemm(x, qw, bias, WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True,
                                                             producer=True), rc)]
    if m <= 16:
        runs.append(lambda: cuda_w4.frag_gemm(x, qw, bias, FragConfig(nw=4, blocks_per_sm=4, stages=8), rc))
    if m <= 64:
        runs.append(lambda: cuda_w4.tile_gemm(x, qw, bias, TileKConfig(), rc))
    plain = [r() for r in runs]
    for p in plain:
        _check(p, expect, 5e-3)
    with dependent_launches():
        assert dependent(x.device)
        chained = [r() for r in runs]  # each waits for the one ahead
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = [r() for r in runs]
    g.replay()
    torch.cuda.synchronize()
    for p, c, cap in zip(plain, chained, captured):
        assert torch.equal(p, c) and torch.equal(p, cap)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m,shape", [(129, (3584, 3584)), (300, (1000, 1040)), (256, (37888, 3584))])
def test_w4_swap_kernel_large_tiles_match_the_exact_reference(name, m, shape):
    """Above 128 rows (the sweep family ``mid``): the swap kernel at every large tile the
    sweep tries, deterministic and the float64 reference (the per-chunk scaled partials of the
    small-M kernels); and the table's pick is what ``quant_linear`` runs, bit for bit."""
    from quarl.bench import sweep
    from quarl.quant.kernels import dispatch, weight_only
    from quarl.quant.kernels.w4_layout import RepackCache

    n, k = shape
    qw, x, bias, exact = _w4_case(n, k, m, name)
    tiles = {c.config._replace(num_stages=3) for c in sweep.family("mid").candidates(m) if c.kernel == "swap"}
    assert len(tiles) >= 4
    for cfg in tiles if name == "w4a16" else list(tiles)[:2]:  # every tile shape once (compiles are slow)
        a = weight_only.swap_gemm(x, qw, bias, cfg)
        assert torch.equal(a, weight_only.swap_gemm(x, qw, bias, cfg)), cfg
        _check(a, exact, 5e-3)
    # the table's row (since s40 the pre-scaled wgmma loop or cuBLAS on the dequantized
    # weight; the swap kernel stays a sweep candidate): what quant_linear runs
    plan = dispatch.lookup("w4a16", "sm90", m, n, k)
    assert plan.kernel in ("wgmma", "dequant"), plan
    assert torch.equal(quant_linear(x, qw, bias), plan.run(x, qw, bias, repacked=RepackCache()))


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [1, 16, 40, 64, 100, 128])
@pytest.mark.parametrize("shape", [(17920, 1536), (1056, 1000)])  # the 1.5B's gate/up; I = 528, odd K, N % 64 != 0
def test_wgmma_gated_epilogue_equals_the_gemm_then_silu_mul(name, m, shape):
    """The wgmma kernel's gated variant (SiLU-and-mul of a [gate; up] weight in its epilogue,
    the "wgmma-gated" layout) at the table's plan, whole column blocks, K split through global
    partials and through clusters: bit for bit the plain kernel (same config) over the weight's
    rows in the gated order, then the engine's SiLU-and-mul kernel. Against the plain kernel
    over the weight as it is: bit for bit where the plan splits every column block alike (a
    tail plan splits only the last wave's blocks, and the reordering moves rows between
    blocks: then the same sums in another split order); and what ``ops.gated_silu_weight_only``
    picks."""
    from quarl.quant import ops
    from quarl.quant.kernels import cuda_w4, dispatch, splitk
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.kernels.device import num_sms
    from quarl.quant.kernels.w4_layout import RepackCache, gated_rows
    from quarl.quant.qweight import QuantizedWeight
    from quarl.rollout.fused import silu_mul

    n, k = shape
    inter = n // 2
    qw, x, _, _ = _w4_case(n, k, m, name)
    order = gated_rows(n, "cuda")
    qg = QuantizedWeight(qw.scheme, qw.shape, qw.qdata[order], qw.scales[order],
                         None if qw.zeros is None else qw.zeros[order])
    gate_pos = torch.nonzero(torch.arange(n, device="cuda") % 16 < 8).flatten()
    plan = dispatch.lookup("w4a16", "sm90", m, n, k)
    assert plan.kernel == "wgmma"
    cfgs = [plan.config, WgConfig(1, 4, 4.0, tail=False), WgConfig(1, 4, 2.0, tail=False, cluster=True),
            WgConfig(2, 3, 1.0, single=True, tail=True), WgConfig(3, 5, 1.0, single=True, tail=True, mbar=True),
            WgConfig(3, 5, 1.0, single=True, tail=True, mbar=True, tma=True), WgConfig(1, 4, 0.1, tail=True)]
    ran = alike = 0
    for cfg in cfgs:
        try:
            cfg.check(m)
        except ValueError:
            continue
        cache = RepackCache()
        got = cuda_w4.wgmma_gemm(x, qw, None, cfg, cache, gated=True)
        assert got.shape == (m, inter)
        reordered = cuda_w4.wgmma_gemm(x, qg, None, cfg)
        assert torch.equal(got, silu_mul(reordered[:, gate_pos], reordered[:, gate_pos + 8])), cfg
        plain = cuda_w4.wgmma_gemm(x, qw, None, cfg, cache)
        want = silu_mul(plain[:, :inter], plain[:, inter:])
        cols = splitk.cdiv(splitk.cdiv(n, 64), cfg.nwg)
        split = cuda_w4._blocked_split(cols, splitk.cdiv(k, 128), num_sms(x.device), cfg.blocks_per_sm, cfg.tail,
                                       cfg.cluster)
        if split.whole in (0, cols):
            assert torch.equal(got, want), cfg
            alike += 1
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
        ran += 1
    assert ran >= 3 and alike >= 1
    got = ops.gated_silu_weight_only(x, qw, RepackCache())  # the table's plan
    assert torch.equal(got, cuda_w4.wgmma_gemm(x, qw, None, plan.config, gated=True))
    plain = quant_linear(x, qw)
    torch.testing.assert_close(got.float(), silu_mul(plain[:, :inter], plain[:, inter:]).float(), rtol=2e-2, atol=2e-3)
    with pytest.raises(ValueError, match="I % 8 == 0"):
        cuda_w4.wgmma_gemm(x, quantize_weight(torch.randn(1048, k, device="cuda"), name), None, plan.config, gated=True)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("m", [17, 64, 100, 300])
@pytest.mark.parametrize("shape", [(17920, 1536), (1056, 1000)])  # the 1.5B's gate/up; odd K, N % 64 != 0
def test_wgmma_prescaled_loop_multiplies_the_learners_dequantized_weight(name, m, shape):
    """The wgmma kernel's pre-scaled loop (``WgConfig.prescale``) at whole column blocks, K
    split through global partials and through clusters, 1-4 warpgroups, past 128 rows in
    128-row tiles (grid y), and in 192- and 256-row tiles (``tile``): deterministic; with
    each row of x two ones in one group of K, bit for bit ``bf16(w[:, k1] + w[:, k2])`` over
    ``w = dequantize(W)`` in bf16 (the learner's weight; the post-scaled loop rounds
    ``s ((u1 - z) + (u2 - z))`` instead, which differs); random x: ``x @ w.T`` in float64 up
    to the order of the sums; the gated epilogue over it is the plain one's over the rows in
    the gated order, then the SiLU-and-mul, bit for bit; with the copies made by the bulk-copy
    engine (``tma``), and those issued by a producer warpgroup (``producer``), the same bits,
    plain and gated. The loop scales with one bf16 multiply, exact on the quantizer's bf16
    scales; a scale that is not a bf16 value is read rounded to nearest."""
    from quarl.quant.kernels import cuda_w4, weight_only
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.kernels.w4_layout import RepackCache, gated_rows
    from quarl.quant.qweight import QuantizedWeight
    from quarl.rollout.fused import silu_mul

    n, k = shape
    qw, x, bias, _ = _w4_case(n, k, m, name)
    assert torch.equal(qw.scales.bfloat16().float(), qw.scales)
    off = QuantizedWeight(qw.scheme, qw.shape, qw.qdata, qw.scales * (1 + 2**-10), qw.zeros)  # not bf16 values
    near = QuantizedWeight(qw.scheme, qw.shape, qw.qdata, off.scales.bfloat16().float(), qw.zeros)
    assert not torch.equal(off.scales, near.scales)
    ps = WgConfig(2, 3, 1.0, tail=True, prescale=True)
    assert torch.equal(cuda_w4.wgmma_gemm(x, off, bias, ps), cuda_w4.wgmma_gemm(x, near, bias, ps))
    w = weight_only.dequantize(qw, torch.bfloat16)
    assert torch.equal(w, qw.dequantize(torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(m)
    grp = torch.randint(0, k // 128, (m,), device="cuda", generator=g)
    k1 = grp * 128 + torch.randint(0, 64, (m,), device="cuda", generator=g)
    k2 = grp * 128 + 64 + torch.randint(0, 64, (m,), device="cuda", generator=g)
    rows = torch.arange(m, device="cuda")
    two = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    two[rows, k1] = 1.0
    two[rows, k2] = 1.0
    want_two = (w[:, k1].float() + w[:, k2].float()).T.to(torch.bfloat16)
    expect = x.double() @ w.double().T + bias.double()
    order = gated_rows(n, "cuda")
    qg = QuantizedWeight(qw.scheme, qw.shape, qw.qdata[order], qw.scales[order],
                         None if qw.zeros is None else qw.zeros[order])
    gate_pos = torch.nonzero(torch.arange(n, device="cuda") % 16 < 8).flatten()
    cfgs = [WgConfig(1, 4, 2.0, tail=False, cluster=True, prescale=True), WgConfig(2, 4, 4.0, prescale=True),
            WgConfig(2, 3, 1.0, tail=True, prescale=True), WgConfig(3, 4, 1.0, tail=True, prescale=True),
            WgConfig(4, 4, 1.0, tail=True, prescale=True), WgConfig(3, 4, 1.0, tail=True, cluster=True, prescale=True),
            WgConfig(1, 4, 0.1, tail=True, prescale=True), WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256),
            WgConfig(1, 3, 1.0, cluster=True, prescale=True, tile=256), WgConfig(2, 4, 1.0, tail=True, prescale=True, tile=192),
            WgConfig(2, 3, 1.0, tail=True, cluster=True, prescale=True, tile=256),  # (the s47 rows at 129-256, with tma)
            WgConfig(2, 6, 1.0, tail=True, prescale=True, tile=256, halves=True),
            WgConfig(1, 7, 1.0, cluster=True, prescale=True, tile=192, halves=True)]
    post_differs = False
    for cfg in cfgs:
        cfg.check(m)
        cache = RepackCache()
        a = cuda_w4.wgmma_gemm(x, qw, bias, cfg, cache)
        assert torch.equal(a, cuda_w4.wgmma_gemm(x, qw, bias, cfg, cache)), cfg
        _check(a, expect, 4e-3)
        assert torch.equal(cuda_w4.wgmma_gemm(two, qw, None, cfg, cache), want_two), cfg
        got = cuda_w4.wgmma_gemm(x, qw, None, cfg, cache, gated=True)
        reordered = cuda_w4.wgmma_gemm(x, qg, None, cfg)
        assert torch.equal(got, silu_mul(reordered[:, gate_pos], reordered[:, gate_pos + 8])), cfg
        tma = cfg._replace(tma=True)  # the copies by the bulk-copy engine: the same bits
        assert torch.equal(cuda_w4.wgmma_gemm(x, qw, bias, tma, cache), a), tma
        assert torch.equal(cuda_w4.wgmma_gemm(x, qw, None, tma, cache, gated=True), got), tma
        if tma.producer_fits():  # ... issued by a producer warpgroup: the same bits
            ws = tma._replace(producer=True)
            assert torch.equal(cuda_w4.wgmma_gemm(x, qw, bias, ws, cache), a), ws
            assert torch.equal(cuda_w4.wgmma_gemm(x, qw, None, ws, cache, gated=True), got), ws
        if m > 128:  # (the post-scaled loops take M <= 128)
            continue
        post = cfg._replace(prescale=False, single=m > 64, tile=0, halves=False, stages=min(cfg.stages, 4))
        post_differs |= not torch.equal(cuda_w4.wgmma_gemm(two, qw, None, post, cache), want_two)
    assert post_differs or m > 128  # the check above can tell the two numerics apart


@pytest.mark.parametrize("n", [1008, 1004])  # whole 8-column chunks; N % 8 != 0: the per-element stores
@pytest.mark.parametrize("tile", [192, 256])
def test_wgmma_staged_epilogue_gives_the_bits_of_the_per_element_stores(n, tile):
    """Blocks over all of K in 192- and 256-row tiles stage their bf16 output tile in shared
    memory and store 16-byte chunks (with the bias, plain, and the gated SiLU-and-mul): bit for
    bit the 128-row tiles' per-element stores over the same sums (no K split, so the same
    products in the same order), ragged rows and columns included."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig

    m, k = 300, 1000
    qw, x, bias, expect = _w4_case(n, k, m, "w4a16")
    staged = WgConfig(2, 3, 1e-3, prescale=True, tile=tile, tma=True, producer=True)
    per_element = WgConfig(2, 3, 1e-3, prescale=True, tma=True)
    got = cuda_w4.wgmma_gemm(x, qw, bias, staged)
    _check(got, expect, 4e-3)
    assert torch.equal(got, cuda_w4.wgmma_gemm(x, qw, bias, per_element))
    if n % 16 == 0:
        assert torch.equal(cuda_w4.wgmma_gemm(x, qw, None, staged, gated=True),
                           cuda_w4.wgmma_gemm(x, qw, None, per_element, gated=True))


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym", "w2a16", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(4736, 3584), (1000, 1040)])  # 1040: a partial last 128-column chunk
def test_dequant_kernel_equals_the_reference_bit_for_bit(name, shape):
    """The learner's weight: the Triton dequantizer (one scale a row per chunk at groups of 128)
    gives the reference's bf16 and fp16 values exactly."""
    from quarl.quant.kernels import weight_only

    qw = quantize_weight(torch.randn(*shape, device="cuda") * 0.02, name)
    for dt in (torch.bfloat16, torch.float16):
        got, want = weight_only.dequantize(qw, dt), qw.dequantize(dt)
        assert got.dtype == dt and torch.equal(got, want), (got - want).abs().max().item()
