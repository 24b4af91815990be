"""Where a training run's low-bit format runs (docs/design.md, "The three training modes").

- ``bf16``: nowhere; the reference.
- ``rollout``: in the engine only. The learner keeps full-precision linears and the
  published weights are quantized at each publish (FlashRL / QuRL).
- ``aligned``: in the engine and the learner (QaRL). The learner's linears are
  :class:`~quarl.quant.QATLinear`: their forward runs the engine's GEMM on the same
  codes, and those codes are what gets published.
"""

from __future__ import annotations

import enum


class QuantMode(str, enum.Enum):
    BF16 = "bf16"
    ROLLOUT = "rollout"
    ALIGNED = "aligned"

    @property
    def engine_quantized(self) -> bool:
        return self is not QuantMode.BF16

    @property
    def learner_quantized(self) -> bool:
        return self is QuantMode.ALIGNED

    def __str__(self) -> str:
        return self.value
