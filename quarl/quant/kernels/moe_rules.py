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
