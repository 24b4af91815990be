"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quarl.quant.kv import check_kv_cache_dtype


@dataclass
class EngineConfig:
    """Sizes and switches of the rollout engine.

    The KV cache gets ``gpu_memory_utilization`` of the GPU's total memory minus what
    the weights and the activations of a warm-up prefill take; on CPU it has
    ``num_kv_blocks`` blocks (also a cap on GPU when set).

    ``kv_cache_dtype``: ``"auto"`` stores K/V in the model dtype; ``"fp8"`` stores e4m3
    codes with a float32 scale per (token, kv head) (:mod:`quarl.quant.kv`): ~1.9x the
    tokens in the same memory (head_dim 128) and half the K/V bytes read per decode step.
    """

    max_num_seqs: int = 256  # sequences decoded together
    max_num_batched_tokens: int = 16384  # prompt tokens per prefill step
    max_model_len: int | None = None  # prompt + completion; None: the model's context, at most 4096
    block_size: int = 16  # tokens per KV block
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None  # fixed cache size (CPU default 512)
    cuda_graphs: bool = True  # decode through CUDA graphs on GPU
    max_graph_batch: int | None = None  # largest captured batch (default max_num_seqs)
    attention_backend: str = "auto"  # "auto" (triton on GPU, torch on CPU), "triton", "torch"
    top_p_candidates: int = 1024  # top-p looks at this many most likely tokens at most
    fused_kernels: bool = True  # Triton backend: fused norm/rotary/SiLU kernels (quarl.rollout.fused)
    tune_decode: bool = True  # on GPU, time a few decode-attention tilings at start-up and keep the best
    share_prompt: bool = True  # the n samples of a prompt share its prefill and KV blocks
    # plan decode step t + 1 on the host while the GPU runs step t and queue it behind t before
    # t's tokens are read (the GPU does not wait for the host between steps)
    lookahead: bool = True
    # decode kernels launched as programmatic dependent launches (Hopper+): each may be
    # scheduled while the one ahead runs and waits for it in its first instruction, hiding
    # the launch latency between the ~10 kernels of a layer; same results. Off elsewhere
    # (before Hopper, on the CPU) whatever this says
    dependent_launches: bool = True
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"  # K/V storage: "auto" (the model dtype) or "fp8" (e4m3 + scales)
    # weight-only schemes: also keep each weight dense (bf16) at a fixed address, so that the
    # batch sizes where a plain GEMM beats the low-bit kernel (prefill; decode above 128 rows;
    # small weights at 65-128 rows on Hopper) run it without dequantizing per call. "auto": on
    # when the copies take at most 10% of the GPU's memory
    dense_weights: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len:
            # A preempted sequence is recomputed in one prefill, so it must fit one step.
            self.max_num_batched_tokens = self.max_model_len
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch, got {self.attention_backend!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.dense_weights not in ("auto", "on", "off"):
            raise ValueError(f"dense_weights must be auto, on or off, got {self.dense_weights!r}")
