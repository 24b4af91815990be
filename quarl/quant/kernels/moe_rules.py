"""Which MoE expert projections the grouped kernel (:mod:`quarl.quant.kernels.moe_gemm`) runs,
without importing Triton (the quantized experts and the benchmarks ask before any kernel is
loaded)."""

from __future__ import annotations

from quarl.quant.scheme import QuantScheme


def moe_kernel_supports(scheme: QuantScheme) -> bool:
    """The schemes the grouped kernel reads: weight-only int4 with groups along K (w4a16,
    w4a16-asym), and 8-bit codes with one scale per output channel (w8a8-int8, w8a8-fp8: the
    kernel takes the rows as the GEMM sees them, quantized and dequantized per token by the
    caller). int2, fp4 and W4A8 keep the dequantize path."""
    if scheme.per_tensor_scale or not scheme.quantizes_weights:
        return False
    if scheme.weight_bits == 4:
        return scheme.weight_format == "int" and scheme.group_size is not None and not scheme.quantizes_activations
    return scheme.weight_bits == 8 and scheme.weight_format in ("int", "fp8") and scheme.group_size is None


# Average rows per expert up to which the grouped kernel runs on a GPU under the `auto`
# backend, by weight bits: past it, dequantizing every expert once and one grouped GEMM cost
# less. From `quarl bench gemm --moe qwen3-30b-a3b` on an H100 (bench/baselines/
# gemm_moe_30b_h100.json, gate_up + down of one layer): int4 g128, kernel vs dequantize:
# 242 vs 1148 us at 4-8 rows per expert, 734 vs 1209 at 128, 4334 vs 2735 at 1024 (the two
# lines cross near 330 rows); 8-bit codes: the kernel wins at every size measured (4518 vs
# 7567 us at 1024 rows per expert).
KERNEL_MAX_AVG_ROWS = {4: 256.0, 8: float("inf")}


def kernel_wins(scheme: QuantScheme, rows: int, num_experts: int) -> bool:
    """Whether the `auto` backend runs the grouped kernel for ``rows`` sorted rows over
    ``num_experts`` experts on a GPU (:data:`KERNEL_MAX_AVG_ROWS`). Decided by shapes alone,
    so a CUDA graph keeps its choice."""
    if not moe_kernel_supports(scheme):
        return False
    return rows <= KERNEL_MAX_AVG_ROWS.get(scheme.weight_bits, 0.0) * max(num_experts, 1)
