"""The learner's forward as compiled regions (CUDA).

Eagerly, every RMSNorm, rotary embedding and SwiGLU of a training forward is a chain of
small float32 and bf16 kernels (cast, square, mean, rsqrt, multiply, cat, ...), forward
and backward, and every linear and reshape between them costs the host a Python call and an
autograd node. :class:`CompiledOps` runs a decoder layer as two regions through
``torch.compile``, written as the model writes them: before attention (q/k/v, q/k norm,
rotary) and after it (output projection, residual adds and norms, the MLP). The elementwise
steps fuse into a few kernels, the backward is derived by AOTAutograd, and the linears enter
as data (:func:`quarl.quant.linear.traceable`): plain weights, or for aligned (QAT) linears
the engine's own computation (a matmul over the dequantized weight, or the GEMM on W8A8 codes:
fp8 ``torch._scaled_mm`` on a GPU, else the op ``quarl::quantized_input_gemm``) with a
straight-through gradient; on a GPU the W8A8 down projection's input codes come from one kernel
over the stacked gate/up rows, whose launch the compiler traces into the region
(:func:`quarl.learner.swiglu.swiglu_codes`). Aligned q/k/v and
gate/up run as one GEMM each (:func:`quarl.quant.linear.qat_group`), as the engine runs them.
A layer with a linear that has no traced form (a reference kernel off the fast path, per-tensor
scales) runs the steps one by one, each still compiled; attention stays outside (the caller's
SDPA). Casts are emulated as eager rounds them, so the values stay those of
:class:`~quarl.model.transformer.TorchOps` up to the order of float32 sums.

Each function goes through :func:`quarl.runtime.compiled`, which marks the batch dimension
of every activation unbacked: a backed size specialises on 1, and a run whose first
micro-batch has one row would compile every function again at its first two-row
micro-batch (seconds, mid-step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quarl.learner.swiglu import swiglu_codes, swiglu_stacked
from quarl.model.moe import SparseMoeBlock
from quarl.model.transformer import MLP, Attention, AttnFn, DecoderLayer, TorchOps, apply_rotary, rms_norm
from quarl.quant.kernels.device import num_sms
from quarl.quant.kv import kv_seen
from quarl.quant.linear import qat_group, traceable
from quarl.quant.scheme import get_scheme
from quarl.quant.traced import traced_linear
from quarl.runtime import compiled


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    stream = residual + x
    return rms_norm(stream, weight, eps), stream


def _rows_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)


def _rows_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _add_rms_norm(x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1]), weight, eps)


def _qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _qk_norm_rope(q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary(rms_norm(q, qw, eps), cos, sin), apply_rotary(rms_norm(k, kw, eps), cos, sin)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as rows ``[B * T, I]`` (see the note on rows below)."""
    return F.silu(gate.reshape(-1, gate.shape[-1])) * up.reshape(-1, up.shape[-1])


def _swiglu_stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a grouped ``[gate; up]`` output, as rows; its backward writes the stacked
    gradient in one pass (:mod:`quarl.learner.swiglu`)."""
    return swiglu_stacked(gate_up.reshape(-1, gate_up.shape[-1]))


def _projected(x: torch.Tensor, lins: tuple[tuple, ...], sizes: list[int]) -> list[torch.Tensor]:
    """The outputs of linears ``lins`` (:func:`~quarl.quant.linear.traced_linear`) on ``x``:
    one per linear, or a single stacked one split by ``sizes``."""
    if len(lins) == 1:
        return list(traced_linear(x, lins[0]).split(sizes, -1))
    return [traced_linear(x, lin) for lin in lins]


# The regions work on rows: ``[B, T, ...]`` activations are viewed as ``[B * T, ...]`` (or
# ``[1, B * T, ...]`` where the model's functions want four dimensions) inside, and leave in
# that form (the caller views them back). Every tensor made inside a region, and every
# gradient flowing into one, then has a single dynamic dimension and plain strides: a tensor
# made as ``[B, T, N]`` (B, T unbacked) gets the stride ``N * Max(1, T)``, and each kernel
# that mixes it with ``N * T`` strided ones indexes through 64-bit divisions by T (the fused
# SwiGLU backward ran at ~1/4 of its bandwidth that way, and copies appeared between the two
# layouts).


def _qkv_region(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv: tuple[tuple, ...],
                qk_norm: tuple | None, heads: tuple[int, int, int], kv_fp8: bool = False):
    """A layer's work before attention: q/k/v projections, q/k norm, rotary (``[1, B * T, heads, D]`` each);
    ``kv_fp8``: K and V as the engine's fp8 KV cache gives them back (:func:`~quarl.quant.kv.kv_seen`)."""
    b, t, width = h.shape
    n_heads, n_kv, d = heads
    q, k, v = _projected(h.reshape(b * t, width), qkv, [n_heads * d, n_kv * d, n_kv * d])
    q, k, v = q.view(1, b * t, n_heads, d), k.view(1, b * t, n_kv, d), v.view(1, b * t, n_kv, d)
    cos, sin = cos.reshape(1, -1, d), sin.reshape(1, -1, d)
    q, k = _qk_rope(q, k, cos, sin) if qk_norm is None else _qk_norm_rope(q, k, *qk_norm, cos, sin)
    if kv_fp8:
        k, v = kv_seen(k), kv_seen(v)
    return q, k, v


def _after_attention_region(out: torch.Tensor, residual: torch.Tensor, o_proj: tuple, post_norm: tuple,
                            gate_up: tuple[tuple, ...], down: tuple, next_norm: tuple, sms: int | None = None):
    """A layer's work after attention: the output projection, residual add + norm, the MLP,
    and the add into the stream normed for the next layer (``*_norm``: weight, eps): the
    normed stream and the stream, ``[B * T, hidden]`` each. ``sms`` (a GPU's SM count, given
    only for a quantized-input down projection): that projection takes its codes from
    :func:`~quarl.learner.swiglu.swiglu_codes`'s kernel, traced into the region (None: from the
    compiler's own quantizer)."""
    width = residual.shape[-1]
    a = traced_linear(out.reshape(-1, out.shape[2] * out.shape[3]), o_proj)
    h, residual = _add_rms_norm(a, residual.reshape(-1, width), *post_norm)
    if len(gate_up) == 1:  # one stacked GEMM
        gu = traced_linear(h, gate_up[0])
        codes = None if sms is None else swiglu_codes(gu.detach(), get_scheme(down[-1]).act_format, sms)
        m = traced_linear(swiglu_stacked(gu), down, codes=codes)
    else:
        m = traced_linear(F.silu(traced_linear(h, gate_up[0])) * traced_linear(h, gate_up[1]), down)
    return _add_rms_norm(m, residual, *next_norm)


def _gpu_sms(device: torch.device) -> int | None:
    """The SM count of a CUDA ``device`` (None elsewhere)."""
    return num_sms(device) if device.type == "cuda" else None


def _traced_group(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> tuple[tuple, ...] | None:
    """``owner``'s linears ``names`` as traced linears: one stacked QAT GEMM (their group),
    or one each; None when one of them has no traced form."""
    group = qat_group(owner, names)
    if group is not None:
        lin = group.traced(x)
        return None if lin is None else (lin,)
    lins = tuple(traceable(getattr(owner, n), x) for n in names)
    return None if any(lin is None for lin in lins) else lins


class CompiledOps(TorchOps):
    """:class:`TorchOps` with RMSNorm (+ residual add), q/k norm + rotary and SwiGLU compiled.

    A decoder layer whose linears all have a traced form (plain, or aligned QAT on the paths
    of :func:`~quarl.quant.linear.traced_qat`) runs as two compiled regions around the
    attention call: fewer, larger graphs, so the host's cost per layer (guards, autograd
    nodes, launches) stays below the GPU's work even for one-row micro-batches. ``fallbacks``
    counts the layer calls that ran step by step instead (tests and profiling read it). An MoE
    layer (:class:`~quarl.model.moe.SparseMoeBlock`) runs step by step by design, its norms and
    rotary compiled, its block's own forward eager on the rows (``moe_layers`` counts those)."""

    fallbacks = 0
    moe_layers = 0

    def block(self, layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, attn: AttnFn, next_norm: nn.Module, next_consumer: nn.Module | None):
        a, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            self.moe_layers += 1
            return super().block(layer, h, residual, cos, sin, attn, next_norm, next_consumer)
        qkv = _traced_group(a, ("q_proj", "k_proj", "v_proj"), h)
        o_proj, down = traceable(a.o_proj, h), traceable(mlp.down_proj, h)
        gate_up = _traced_group(mlp, ("gate_proj", "up_proj"), h)
        b, t, width = h.shape
        if qkv is None or gate_up is None or o_proj is None or down is None or b * t == 1:
            self.fallbacks += 1
            return super().block(layer, h, residual, cos, sin, attn, next_norm, next_consumer)
        qk_norm = None if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps)
        # K/V rounding for an fp8 engine cache fuses into the rotary kernel here, not in the attention callable
        kv_fp8 = getattr(attn, "kv_quant", None) == "fp8"
        q, k, v = compiled(_qkv_region)(h, cos, sin, qkv, qk_norm, (a.n_heads, a.n_kv, a.head_dim), kv_fp8)
        sdpa = attn.unrounded if kv_fp8 else attn
        out = sdpa(a.layer_idx, q.view(b, t, a.n_heads, -1), k.view(b, t, a.n_kv, -1), v.view(b, t, a.n_kv, -1))
        post = layer.post_attention_layernorm
        sms = _gpu_sms(h.device) if down[0] == "quantized_input" else None
        h, residual = compiled(_after_attention_region)(out, residual, o_proj, (post.weight, post.eps), gate_up,
                                                         down, (next_norm.weight, next_norm.eps), sms)
        return h.view(b, t, width), residual.view(b, t, width)

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        if residual is None:
            return compiled(_rows_rms_norm)(x, norm.weight, norm.eps).view(x.shape), x
        h, stream = compiled(_rows_add_rms_norm)(x, residual, norm.weight, norm.eps)
        return h.view(x.shape), stream.view(x.shape)

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

    def mlp(self, module: MLP | SparseMoeBlock, h: torch.Tensor) -> torch.Tensor:
        if isinstance(module, SparseMoeBlock):  # routing, grouped experts: the block's own forward on the rows
            return module(h.reshape(-1, h.shape[-1])).view(h.shape)
        gu = qat_group(module, ("gate_proj", "up_proj"))
        if gu is not None:
            m = compiled(_swiglu_stacked)(gu.stacked(h))
        else:
            m = compiled(_swiglu)(module.gate_proj(h), module.up_proj(h))
        return module.down_proj(m.view(*h.shape[:-1], -1))


COMPILED_OPS = CompiledOps()
