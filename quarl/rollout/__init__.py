"""Rollout engine: continuous batching over a paged KV cache, CUDA-graph decode,
sampling with per-token log-probs (the design follows nano-vllm).

Data flow of one step: :class:`Scheduler` (no tensors) picks a prefill or decode batch
and the block copies it needs from :class:`BlockManager`; :class:`ModelRunner` builds
the step's :class:`StepContext`, runs the model with :class:`PagedAttention` (Triton
kernels on GPU, torch on CPU; decode through CUDA graphs) and samples with
:class:`Sampler`; the scheduler appends the tokens and retires finished sequences.

The cache holds K/V in the model dtype, or (``EngineConfig.kv_cache_dtype="fp8"``) e4m3
codes with a float32 scale per (token, kv head), quantized as they are written and
dequantized before the attention dots (:mod:`quarl.quant.kv`).
"""

from quarl.rollout.config import EngineConfig
from quarl.rollout.engine import Completion, Engine, GenerateStats, LogprobMismatchError
from quarl.rollout.sampling_params import SamplingParams

__all__ = ["Completion", "Engine", "EngineConfig", "GenerateStats", "LogprobMismatchError", "SamplingParams"]
