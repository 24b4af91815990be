"""What stays in GPU memory through the learner phase, decided from the first update's peak.

- The engine's KV cache (``rollout.kv_cache_in_update``): kept (no re-allocation per step)
  or released while the learner runs; ``auto`` keeps it where the learner's peak plus the
  cache fit in 90% of the GPU.
- A LoRA learner's frozen low-bit base: dequantized once per update and kept dense
  (:func:`~quarl.learner.memory.keep_frozen_bases_dense`) where its bf16 size fits on top,
  else dequantized at every GEMM.
"""

from __future__ import annotations

from typing import Callable

import torch

from quarl.learner.memory import dense_bytes, frozen_bases, keep_frozen_bases_dense
from quarl.rollout import EngineConfig


class MemoryPolicy:
    """The two decisions: ``keep_kv`` and ``dense_base`` (None: decided after the first
    learner phase, by :meth:`after_learner`; on CPU the cache is host memory and stays)."""

    def __init__(self, kv_cache_in_update: str, device: torch.device, learner_model, engine,
                 say: Callable[[str], None]) -> None:
        self.device, self.learner_model, self.engine, self.say = device, learner_model, engine, say
        cuda = device.type == "cuda"
        self.keep_kv: bool | None = {"keep": True, "release": False}.get(kv_cache_in_update,
                                                                         True if not cuda else None)
        self.dense_base: bool | None = None if cuda and frozen_bases(learner_model) else False

    def after_learner(self, learner_peak_gb: float, kv_counted: bool) -> None:
        """Decide what is still open from the learner phase's peak (``kv_counted``: the KV cache
        stayed through it, so the peak holds it); the KV cache's decision comes first."""
        if self.keep_kv is None:
            self.keep_kv = kv_cache_fits(self.device, self.engine.kv_cache_bytes, learner_peak_gb, self.say)
        if self.dense_base is None:
            self.dense_base = dense_base_fits(self.learner_model, self.device, self.engine.kv_cache_bytes,
                                              learner_peak_gb, kv_counted, self.keep_kv, self.say)


def kv_cache_fits(device: torch.device, kv_bytes: int, learner_peak_gb: float, say: Callable[[str], None]) -> bool:
    """Whether the KV cache can stay through the learner phase (``kv_cache_in_update=auto``)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fits = learner_peak_gb * 2**30 + kv_bytes <= 0.9 * total
    say(f"KV cache ({kv_bytes / 2**30:.1f} GB) {'kept' if fits else 'released'} during the learner phase: "
        f"learner peak {learner_peak_gb:.1f} GB, GPU {total / 2**30:.0f} GB")
    return fits


def dense_base_fits(model, device: torch.device, kv_bytes: int, learner_peak_gb: float, kv_counted: bool,
                    keep_kv: bool | None, say: Callable[[str], None]) -> bool:
    """Whether a LoRA learner can keep its frozen base dequantized through each update
    (:func:`~quarl.learner.memory.keep_frozen_bases_dense`): its bf16 size on top of the
    first update's peak (plus the KV cache when it stays and was not in that peak) within
    90% of the GPU; the bases are switched accordingly."""
    dense = dense_bytes(frozen_bases(model), model.embed_tokens.weight.dtype)
    total = torch.cuda.get_device_properties(device).total_memory
    kv = kv_bytes if keep_kv and not kv_counted else 0
    fits = learner_peak_gb * 2**30 + kv + dense <= 0.9 * total
    keep_frozen_bases_dense(model, fits)
    say(f"LoRA base ({dense / 2**30:.1f} GB in bf16) {'kept dense' if fits else 'dequantized per GEMM'} "
        f"during the learner phase: learner peak {learner_peak_gb:.1f} GB, GPU {total / 2**30:.0f} GB")
    return fits


def larger_cache(engine: EngineConfig, device: torch.device, num_blocks: int) -> str:
    """How to give the engine's KV cache (now ``num_blocks`` blocks) more room."""
    if device.type != "cuda" or engine.num_kv_blocks:
        return f"Raise rollout.engine.num_kv_blocks (now {num_blocks})"
    return ("Give the cache more memory: raise rollout.engine.gpu_memory_utilization "
            f"(now {engine.gpu_memory_utilization:g})")
