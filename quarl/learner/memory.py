"""A LoRA learner's memory policy for its frozen low-bit bases: what keeping them dense costs,
keeping them dense through an update, and freeing them after it."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from quarl.quant.linear import QuantLinear


def frozen_bases(model: nn.Module) -> list[QuantLinear]:
    """The frozen low-bit bases of a LoRA learner (``QuantLinear`` with ``learner_path``)."""
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.learner_path]


def dense_bytes(mods: Iterable[QuantLinear], dtype: torch.dtype) -> int:
    """What the modules' weights take dequantized to ``dtype``."""
    return sum(m.out_features * m.in_features for m in mods) * dtype.itemsize


def keep_frozen_bases_dense(model: nn.Module, on: bool = True) -> None:
    """Whether a LoRA learner keeps each frozen base weight dequantized from its first GEMM of
    an update to the update's end (:meth:`~quarl.learner.Learner.release_caches`), instead of dequantizing
    it at every GEMM (forward and backward of every micro-batch; docs/lora.md). Costs
    the base's size in bf16 during the update; the values are the same either way."""
    for m in frozen_bases(model):
        m.repacked.keep_dequantized = on
        if not on:
            m.repacked.drop_dequantized()


def drop_dense_bases(model: nn.Module) -> None:
    """Free the dequantized weights the frozen bases keep (:func:`keep_frozen_bases_dense`)."""
    for m in frozen_bases(model):
        m.repacked.drop_dequantized()
