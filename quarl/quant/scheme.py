"""Quantization schemes: one frozen vocabulary object per format.

A :class:`QuantScheme` says how a linear layer's weights (and, for W8A8/W4A8, its
activations) are quantized. The learner (``QATLinear``), the rollout engine
(``QuantLinear``) and the exporter all receive the same object, and it is written into
checkpoints by name, so the three can never disagree about a format.

The table below is normative (docs/design.md, "Quantization formats"):

======================  =====================================  ====================
name                    weights                                activations
======================  =====================================  ====================
``bf16``                unquantized                            unquantized
``w8a8-int8``           int8, per output channel, symmetric    int8, per token
``w8a8-fp8``            e4m3, per output channel               e4m3, per token
``w4a16``               int4, groups of 128 along K, symmetric bf16
``w4a16-asym``          int4, g128, zero point                 bf16
``w4a8-int8``           int4, g128, symmetric                  int8, per token
``nvfp4``               e2m1, g16, e4m3 scales x fp32 tensor   bf16 (emulated)
``mxfp4``               e2m1, g32, e8m0 scales                 bf16 (emulated)
``w2a16``               int2, g64, zero point                  bf16
======================  =====================================  ====================

All weight quantizers round to nearest (ties to even) with scales from the max-abs
(or min/max) of each channel/group, optionally shrunk by ``clip_ratio``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

# Sub-byte formats pad K to a multiple of this and pack within each chunk of PACK_K
# columns (see quarl.quant.reference for the bit layout). Every group size divides it.
PACK_K = 128


@dataclass(frozen=True)
class QuantScheme:
    """How one linear layer is quantized.

    weight_format: ``"none" | "int" | "fp8" | "fp4"`` (fp8 = e4m3, fp4 = e2m1).
    weight_bits: 16, 8, 4 or 2.
    group_size: elements of K sharing one scale; ``None`` = one per output channel.
    symmetric: ``False`` adds an unsigned zero point per group (int formats only).
    scale_format: how group scales are stored: ``"fp32"``, ``"e4m3"`` (nvfp4, times a
        per-tensor fp32 scale) or ``"e8m0"`` (mxfp4, powers of two).
    act_format: ``"none" | "int8" | "fp8"``: dynamic per-token symmetric quantization of
        the input activations, done inside the GEMM call.
    clip_ratio: multiplies the max-abs before the scale is computed (1.0 = no clipping).
    """

    name: str
    weight_format: str = "none"
    weight_bits: int = 16
    group_size: int | None = None
    symmetric: bool = True
    scale_format: str = "fp32"
    act_format: str = "none"
    clip_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.weight_format not in ("none", "int", "fp8", "fp4"):
            raise ValueError(f"unknown weight_format {self.weight_format!r}")
        if self.act_format not in ("none", "int8", "fp8"):
            raise ValueError(f"unknown act_format {self.act_format!r}")
        if self.group_size is not None and (self.group_size <= 0 or PACK_K % self.group_size):
            raise ValueError(f"group_size must divide {PACK_K}, got {self.group_size}")
        if self.packed and self.group_size is None:
            raise ValueError(f"{self.name}: sub-byte formats need a group_size")
        if not 0.0 < self.clip_ratio <= 1.0:
            raise ValueError(f"clip_ratio must be in (0, 1], got {self.clip_ratio}")

    @property
    def quantizes_weights(self) -> bool:
        return self.weight_format != "none"

    @property
    def quantizes_activations(self) -> bool:
        return self.act_format != "none"

    @property
    def per_tensor_scale(self) -> bool:
        """nvfp4: its group scales are relative to one fp32 scale per weight tensor, so
        weights quantized apart cannot be stacked by rows (every other format scales per
        row or per group of a row)."""
        return self.scale_format == "e4m3"

    @property
    def packed(self) -> bool:
        """True for sub-byte formats (several codes per byte, K padded to PACK_K)."""
        return self.weight_format in ("int", "fp4") and self.weight_bits < 8

    @property
    def bits_per_weight(self) -> float:
        """Storage cost per weight including scales/zeros (for memory floors)."""
        if not self.quantizes_weights:
            return 16.0
        if self.group_size is None:
            return float(self.weight_bits)
        scale_bits = 32 if self.scale_format == "fp32" else 8
        zero_bits = 0 if self.symmetric else 8
        return self.weight_bits + (scale_bits + zero_bits) / self.group_size

    def replace(self, **changes) -> "QuantScheme":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_config(cls, value: "str | QuantScheme") -> "QuantScheme":
        """A config value (a scheme name) as the scheme; unknown names name the closest one."""
        if isinstance(value, QuantScheme):
            return value
        if not isinstance(value, str) or value not in SCHEMES:
            close = difflib.get_close_matches(str(value), list(SCHEMES), n=1, cutoff=0.4)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown quantization scheme {value!r}{hint}; schemes: {', '.join(SCHEMES)}")
        return SCHEMES[value]

    def to_config(self) -> str:
        if SCHEMES.get(self.name) != self:
            raise ValueError(f"scheme {self.name!r} differs from the registered one; a config can only name "
                             "registered schemes")
        return self.name


SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme("bf16"),
        QuantScheme("w8a8-int8", "int", 8, act_format="int8"),
        QuantScheme("w8a8-fp8", "fp8", 8, act_format="fp8"),
        QuantScheme("w4a16", "int", 4, group_size=128),
        QuantScheme("w4a16-asym", "int", 4, group_size=128, symmetric=False),
        QuantScheme("w4a8-int8", "int", 4, group_size=128, act_format="int8"),
        QuantScheme("nvfp4", "fp4", 4, group_size=16, scale_format="e4m3"),
        QuantScheme("mxfp4", "fp4", 4, group_size=32, scale_format="e8m0"),
        QuantScheme("w2a16", "int", 2, group_size=64, symmetric=False),
    )
}


def get_scheme(name: str | QuantScheme) -> QuantScheme:
    """The scheme called ``name`` (a QuantScheme passes through unchanged)."""
    return QuantScheme.from_config(name)
