"""The learner's forward with its elementwise steps compiled (CUDA).

Eagerly, every RMSNorm, rotary embedding and SwiGLU of a training forward is a chain of
small float32 and bf16 kernels (cast, square, mean, rsqrt, multiply, cat, ...), forward
and backward. :class:`CompiledOps` runs the same steps, written as the model writes
them, through ``torch.compile`` so that each becomes one or two fused kernels with the
backward derived by AOTAutograd. The linears and attention stay outside the compiled
regions (the quantized linears have their own autograd functions). Aligned (QAT) q/k/v and
gate/up projections run as one GEMM each (:func:`quarl.quant.linear.qat_group`), as the
engine runs them: fewer launches and Python autograd nodes per micro-batch. Casts are emulated
as eager rounds them, so the values stay those of :class:`~quarl.model.transformer.TorchOps`
up to the order of float32 sums.

Each function goes through :func:`quarl.runtime.compiled`, which marks the batch dimension
of every activation unbacked: a backed size specialises on 1, and a run whose first
micro-batch has one row would compile every function again at its first two-row
micro-batch (seconds, mid-step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quarl.model.transformer import MLP, Attention, AttnFn, TorchOps, apply_rotary, rms_norm
from quarl.quant.linear import qat_group
from quarl.runtime import compiled


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    stream = residual + x
    return rms_norm(stream, weight, eps), stream


def _qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _qk_norm_rope(q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary(rms_norm(q, qw, eps), cos, sin), apply_rotary(rms_norm(k, kw, eps), cos, sin)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a grouped ``[gate; up]`` output: the halves are split inside the compiled
    region, so its backward writes the stacked gradient in one kernel (no concatenation)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class CompiledOps(TorchOps):
    """:class:`TorchOps` with RMSNorm (+ residual add), q/k norm + rotary and SwiGLU compiled."""

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        if residual is None:
            return compiled(rms_norm)(x, norm.weight, norm.eps), x
        return compiled(_add_rms_norm)(x, residual, norm.weight, norm.eps)

    def attention(self, module: Attention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttnFn) -> torch.Tensor:
        b, t, _ = h.shape
        qkv = qat_group(module, ("q_proj", "k_proj", "v_proj"))
        q, k, v = qkv(h) if qkv is not None else (module.q_proj(h), module.k_proj(h), module.v_proj(h))
        q = q.view(b, t, module.n_heads, module.head_dim)
        k = k.view(b, t, module.n_kv, module.head_dim)
        v = v.view(b, t, module.n_kv, module.head_dim)
        if module.q_norm is not None:
            q, k = compiled(_qk_norm_rope)(q, k, module.q_norm.weight, module.k_norm.weight, module.q_norm.eps,
                                            cos, sin)
        else:
            q, k = compiled(_qk_rope)(q, k, cos, sin)
        out = attn(module.layer_idx, q, k, v)
        return module.o_proj(out.reshape(b, t, -1))

    def mlp(self, module: MLP, h: torch.Tensor) -> torch.Tensor:
        gu = qat_group(module, ("gate_proj", "up_proj"))
        if gu is not None:
            return module.down_proj(compiled(_swiglu_stacked)(gu.stacked(h)))
        return module.down_proj(compiled(_swiglu)(module.gate_proj(h), module.up_proj(h)))


COMPILED_OPS = CompiledOps()
