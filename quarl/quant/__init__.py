"""Quantization for QaRL: formats, reference math, Triton kernels, quantized linears, UAQ.

One set of low-bit kernels serves the rollout engine (:class:`QuantLinear`) and the
learner (:class:`QATLinear`); see :mod:`quarl.quant.reference` for the formats' exact
definitions and bit layouts and :mod:`quarl.quant.kernels` for the fast paths.
"""

from quarl.quant.linear import QATLinear, QuantLinear, quantize_model
from quarl.quant.publish import load_published, publish_model
from quarl.quant.mode import QuantMode
from quarl.quant.metrics import rel_quant_err, rel_update, update_visible_frac
from quarl.quant.ops import get_backend, quant_linear, set_backend, use_backend
from quarl.quant.qweight import QuantizedWeight, empty_quantized, quantize_weight, quantize_weights
from quarl.quant.reference import reference_linear
from quarl.quant.scheme import PACK_K, SCHEMES, QuantScheme, get_scheme
from quarl.quant.uaq import apply_uaq, remove_uaq

__all__ = [
    "PACK_K",
    "SCHEMES",
    "QATLinear",
    "QuantLinear",
    "QuantMode",
    "QuantScheme",
    "QuantizedWeight",
    "apply_uaq",
    "empty_quantized",
    "get_backend",
    "get_scheme",
    "load_published",
    "publish_model",
    "quant_linear",
    "quantize_model",
    "quantize_weight",
    "quantize_weights",
    "reference_linear",
    "rel_quant_err",
    "rel_update",
    "remove_uaq",
    "set_backend",
    "update_visible_frac",
    "use_backend",
]
