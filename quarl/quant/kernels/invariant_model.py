"""Exact mode's forward: the steps of :meth:`~quarl.model.transformer.Transformer.hidden_states`
over the batch-invariant kernels, run alike by the rollout engine and the learner.

With ``model.exact`` set (an :class:`ExactMode`, by ``quarl.trainer.weights`` on the engine's
model and the learner's), both sides run :class:`ExactOps`:

* every linear (q/k/v/o, gate/up/down) through :func:`.invariant.invariant_linear`, the LM
  head through :func:`.invariant.dense_gemm` (:func:`exact_logits`; the learner's
  ``quarl.learner.logprobs``), each row's bits independent of the batch. A quantized linear
  (aligned mode) runs the invariant GEMM of its scheme on its quantized weight (weight-only:
  the packed GEMM; W8A8: each row's per-token codes, then the code GEMM): the
  engine's :class:`~quarl.quant.linear.QuantLinear` on its buffers, the learner's
  :class:`~quarl.quant.linear.QATLinear` on the tensors it publishes (the engine's, once
  published), so both multiply the same codes in the same order;
* every RMSNorm (the layers', the final one, Qwen3's per-head q / k norms) through
  :func:`.invariant_norm.invariant_rms_norm`; the residual adds, rotary and SiLU-and-mul stay
  torch's elementwise ops, the same per element whatever the shape;
* attention through the one paged kernel of :mod:`.invariant_attention`: the engine's prefill
  and decode over its cache, the learner's micro-batch through
  :func:`.invariant_attention.invariant_varlen_attention` (its K / V paged as the engine's
  cache, fp8 codes included) (:func:`exact_batch_attention`).

The learner's forward runs under autograd: each op is a :class:`torch.autograd.Function`
whose forward is the invariant kernel and whose backward is the ordinary one (a linear's
two GEMMs, straight-through for a ``QATLinear``: ``grad_x = grad_y @ W_deq`` and ``grad_W =
grad_y^T @ x`` to its master weight; a norm or the attention recomputed through the
differentiable torch path, whose gradient is that of the same function up to rounding).
Covered: plain ``nn.Linear`` layers, weight-only and W8A8 ``QuantLinear`` / ``QATLinear`` (the
W8A8 backward straight-through the activation quantizer too, as the ordinary aligned learner's)
dense MLPs and MoE blocks (:mod:`.invariant_moe`); a W4A8 linear or experts with LoRA adapters
raise (the run config refuses those settings first, ``RunConfig._check_exact``).
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from quarl.model.lora import LoRALinear
from quarl.model.moe import SparseMoeBlock
from quarl.model.transformer import MLP, AttnFn, CheckpointedOps, TorchOps, apply_rotary, batch_attention, rms_norm
from quarl.quant.kernels.invariant import SMALL_M, dense_gemm, invariant_linear
from quarl.quant.kernels.invariant_autograd import invariant_or_recomputed, needs_grad
from quarl.quant.kernels.invariant_attention import PageLayout, invariant_varlen_attention, page_layout
from quarl.quant.kernels.invariant_moe import exact_moe_block
from quarl.quant.kernels.invariant_norm import invariant_rms_norm
from quarl.quant.linear import QATLinear, QuantLinear
from quarl.quant.ops import dequantize
from quarl.quant.qweight import QuantizedWeight


class ExactMode(NamedTuple):
    """What the learner's exact forward must know of the engine: its KV block size (the
    learner pages its K / V the same way) and whether its cache holds fp8 K / V; and how its
    update forward takes gradients (``quant.exact_update``: "recompute" or "autograd",
    :func:`quarl.learner.logprobs.sequence_logprobs`)."""

    page: int
    kv_fp8: bool = False
    update: str = "recompute"


def require_kernels(device: torch.device) -> None:
    """Exact mode runs Triton kernels: on a CUDA device, or on the CPU through Triton's
    interpreter (``TRITON_INTERPRET=1`` before quarl loads its kernels; slow, for tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"exact mode (quant.exact=true) runs Triton kernels, which need a CUDA device; on "
                           f"{device.type} only through Triton's interpreter (TRITON_INTERPRET=1, slow): run on a "
                           "GPU, or set quant.exact=false")


class _InvariantLinear(torch.autograd.Function):
    """Forward: the batch-invariant GEMM on ``weight`` (dense), or on ``qw`` (a packed
    weight-only weight, the quantized ``weight``). Backward: ``g @ W`` and ``g.T @ x`` (as
    ``F.linear``'s), with ``W`` the dequantized ``qw`` where there is one (straight-through:
    the gradient of ``W_deq`` goes to the master ``weight``), made by ``deq(dtype)``
    (:func:`_dequantizer`: the module's cache of it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, qw, deq):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.qw, ctx.deq = bias is not None, qw, deq
        return _linear(x, weight, bias, qw, deq)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(g2.dtype) if ctx.qw is None else ctx.deq(g2.dtype)
        gx = (g2 @ w).view(x.shape).to(x.dtype) if need_x else None
        gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype) if need_w else None
        gb = g2.sum(0) if ctx.has_bias and need_b else None
        return gx, gw, gb, None, None


def _dequantizer(module: nn.Module | None, qw: QuantizedWeight | None) -> Callable[[torch.dtype], torch.Tensor] | None:
    """``dtype -> qw`` dequantized, through ``module``'s cache of it (``repacked``: a QAT linear
    keeps it per weight version, as its ordinary forward does) where it has one (None: none)."""
    if qw is None:
        return None
    cache = getattr(module, "repacked", None)
    if cache is None:
        return lambda dtype: dequantize(qw, dtype)

    def cached(dtype: torch.dtype) -> torch.Tensor:
        return cache.dequantized(qw, dtype, dequantize)

    cached.cached = True  # (read by _linear: a cached dequantization costs nothing per call)
    cached.dense = cache.dense  # (the engine keeps this copy: no dequantization per call at any M)
    return cached


def _linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, qw: QuantizedWeight | None,
            deq: Callable[[torch.dtype], torch.Tensor] | None) -> torch.Tensor:
    """The invariant GEMM of ``x`` on ``qw`` (else ``weight``); on a GPU, for 16-bit ``x`` and a
    packed weight-only ``qw``, the dense kernel on its dequantized weight where that is kept
    (:func:`_dense_route`): the same bits (the same values, dequantized and rounded as the
    packed kernel does in registers, summed in the same K steps and segments) at the dense
    kernel's speed."""
    if _dense_route(x, qw, deq):
        return invariant_linear(x, deq(x.dtype), bias)
    return invariant_linear(x, weight if qw is None else qw, bias)


def _dense_route(x: torch.Tensor, qw: QuantizedWeight | None,
                 deq: Callable[[torch.dtype], torch.Tensor] | None) -> bool:
    """Whether :func:`_linear` runs the dense kernel on ``deq``'s copy: the engine's dense copy
    (``rollout.engine.dense_weights``) at any M, the learner's per-step copy (a QAT linear's
    cache) above :data:`~.invariant.SMALL_M` rows. (Not under the interpreter, whose tile for
    dense weights sums K in other steps than the packed kernel's.)"""
    if (qw is None or deq is None or not getattr(deq, "cached", False) or not x.is_cuda
            or x.dtype == torch.float32 or qw.scheme.quantizes_activations):
        return False
    return getattr(deq, "dense", False) or x.numel() > SMALL_M * x.shape[-1]


def _fused_linear(fused, h: torch.Tensor) -> torch.Tensor:
    """The engine's fused q/k/v or gate/up GEMM (:func:`_fused`) on its buffer: dense, or
    quantized through :func:`_linear` (its own dense copy where the engine keeps one)."""
    if isinstance(fused.weight, QuantizedWeight):
        return _linear(h, None, fused.bias, fused.weight, _dequantizer(fused, fused.weight))
    return invariant_linear(h, fused.weight, fused.bias)


def exact_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through the batch-invariant GEMM (differentiable where gradients are on):
    a plain ``nn.Linear`` on its weight, a :class:`QuantLinear` (the engine's) on its quantized
    buffers, a :class:`QATLinear` (the learner's) on its quantized master weight, straight-through
    to the master; a LoRA layer (a frozen base with an enabled adapter) as :func:`exact_lora`."""
    w, qw = _exact_weights(module)
    b = module.bias
    ad = getattr(module, "lora", None)
    if ad is not None and ad.enabled:
        return exact_lora(x, w if qw is None else qw, b, ad.A, ad.B, ad.scaling, _dequantizer(module, qw))
    deq = _dequantizer(module, qw)
    if needs_grad(x, w, b):
        return _InvariantLinear.apply(x, w, b, qw, deq)
    return _linear(x, w, b, qw, deq)


def exact_dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` through the batch-invariant GEMM, differentiable (an MoE router)."""
    if needs_grad(x, weight):
        return _InvariantLinear.apply(x, weight, None, None, None)
    return invariant_linear(x, weight)


def _lora_forward(x: torch.Tensor, base: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                  a: torch.Tensor, b: torch.Tensor, scaling: float,
                  deq: Callable[[torch.dtype], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, xa)``: ``y = base(x) + scaling * (x A^T) B^T`` with each GEMM batch-invariant (a
    quantized base through :func:`_linear`, with ``deq``) and the sum elementwise (in fp32,
    rounded once to x's dtype); ``xa = x A^T`` (x's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    xa = dense_gemm(x2, a)
    dense = isinstance(base, torch.Tensor)
    y_base = _linear(x2, base if dense else None, bias, None if dense else base, deq)
    y = y_base.float() + dense_gemm(xa, b).float() * scaling
    return y.to(x.dtype).view(*x.shape[:-1], -1), xa


class _InvariantLoRA(torch.autograd.Function):
    """Forward :func:`_lora_forward`; backward that of ``F.linear(x, W) + scaling * B (A x)`` with
    the base frozen (``W`` dequantized by ``deq`` where it is quantized: straight-through to x)."""

    @staticmethod
    def forward(ctx, x, a, b, base, bias, scaling, deq):  # type: ignore[override]
        y, xa = _lora_forward(x, base, bias, a, b, scaling, deq)
        ctx.save_for_backward(x, a, b, xa)
        ctx.base, ctx.scaling, ctx.deq = base, scaling, deq
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, a, b, xa = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(g.dtype)
        gd = g * ctx.scaling
        gxa = gd @ b.to(g.dtype)
        ga = (gxa.t() @ x2).to(a.dtype)
        gb = (gd.t() @ xa.to(g.dtype)).to(b.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            w = ctx.base.to(g.dtype) if isinstance(ctx.base, torch.Tensor) else ctx.deq(g.dtype)
            gx = (g @ w + gxa @ a.to(g.dtype)).view(x.shape).to(x.dtype)
        return gx, ga, gb, None, None, None, None


def exact_lora(x: torch.Tensor, base: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
               a: torch.Tensor, b: torch.Tensor, scaling: float,
               deq: Callable[[torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """A LoRA layer ``base(x) + scaling * B (A x)`` over the batch-invariant GEMMs, the same bits
    in the engine (its copy of the adapter) and the learner; gradients to x, A and B (the base
    is frozen: a dense tensor, or a quantized weight, any scheme :func:`invariant_linear` runs;
    ``deq(dtype)``: its dequantized form for the backward, default made per call)."""
    if needs_grad(x, a, b):
        if deq is None and not isinstance(base, torch.Tensor):
            deq = _dequantizer(None, base)
        return _InvariantLoRA.apply(x, a, b, base, bias, scaling, deq)
    return _lora_forward(x, base, bias, a, b, scaling, deq)[0]


def _exact_weights(module: nn.Module) -> tuple[torch.Tensor | None, QuantizedWeight | None]:
    """``(weight, quantized)`` of a linear that :func:`exact_linear` runs: the dense (or master)
    weight, and the quantized weight the GEMM reads (None: dense); raises for the rest."""
    if type(module) is nn.Linear or isinstance(module, LoRALinear):
        return module.weight, None
    if type(module) not in (QuantLinear, QATLinear):
        raise NotImplementedError(f"exact mode runs nn.Linear, QuantLinear and QATLinear layers only, not "
                                  f"{type(module).__name__}")
    sc = module.scheme
    if sc.quantizes_activations and sc.packed:
        raise NotImplementedError(f"exact mode has no W4A8 GEMM ({sc.name} on {type(module).__name__}): it runs "
                                  "weight-only packed schemes and W8A8 (w8a8-int8, w8a8-fp8)")
    if isinstance(module, QuantLinear):
        return None, module.qweight
    return module.weight, module.quantized_weight()


def exact_rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(x)`` (an RMSNorm module) through the batch-invariant kernel."""
    w, eps = norm.weight, norm.eps
    return invariant_or_recomputed(lambda a, b: invariant_rms_norm(a, b, eps), lambda a, b: rms_norm(a, b, eps), x, w)


def exact_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary(x, cos, sin)`` (x ``[B, T, H, D]``): on a GPU the engine's fused rotary
    kernel, which rounds where torch's ops round (the same bits: tests_gpu/rollout/
    test_gpu_rollout.py), in one launch instead of five; backward through torch's ops."""
    if not x.is_cuda or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return apply_rotary(x, cos, sin)
    from quarl.rollout.fused import rope

    b, t, h, d = x.shape

    def fast(a: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return rope(a.reshape(b * t, h, d), c.reshape(b * t, d), s.reshape(b * t, d)).view(b, t, h, d)

    return invariant_or_recomputed(fast, apply_rotary, x, cos, sin)


def _silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def exact_silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u``: on a GPU the engine's fused kernel (torch's roundings, the same bits, as
    :func:`exact_rotary`); backward through torch's ops."""
    if not g.is_cuda:
        return _silu_mul_ref(g, u)
    from quarl.rollout.fused import silu_mul

    return invariant_or_recomputed(silu_mul, _silu_mul_ref, g, u)


def _fused(owner: nn.Module, name: str, h: torch.Tensor):
    """The engine's fused q/k/v or gate/up linear of ``owner`` (:func:`~quarl.rollout.fused.fuse_projections`),
    where exact mode can run it as one GEMM: without adapters, no gradient. Each output column
    is its own dot product over the same K walk whatever the width N (the tile that N picks is
    one of a family of the same bits, :mod:`.invariant`), so the fused GEMM gives each of the
    linears' columns the bits the learner's separate GEMMs give it."""
    fused = getattr(owner, name, None)
    if fused is None or fused.adapters is not None or torch.is_grad_enabled() and h.requires_grad:
        return None
    return fused


class ExactOps(TorchOps):
    """:class:`~quarl.model.transformer.TorchOps` over the batch-invariant kernels (module doc)."""

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        if residual is not None and x.is_cuda and not needs_grad(x, residual, norm.weight):
            return invariant_rms_norm(x, norm.weight, norm.eps, residual)  # (the add fused: the same bits)
        residual = x if residual is None else residual + x
        return exact_rms_norm(residual, norm), residual

    def attention(self, module: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttnFn) -> torch.Tensor:
        b, t, _ = h.shape
        fused = _fused(module, "_fused_qkv", h)
        if fused is not None:
            qkv = _fused_linear(fused, h)
            nq, nkv = module.n_heads * module.head_dim, module.n_kv * module.head_dim
            q = qkv[..., :nq].view(b, t, module.n_heads, module.head_dim)
            k = qkv[..., nq : nq + nkv].view(b, t, module.n_kv, module.head_dim)
            v = qkv[..., nq + nkv :].view(b, t, module.n_kv, module.head_dim)
        else:
            q = exact_linear(module.q_proj, h).view(b, t, module.n_heads, module.head_dim)
            k = exact_linear(module.k_proj, h).view(b, t, module.n_kv, module.head_dim)
            v = exact_linear(module.v_proj, h).view(b, t, module.n_kv, module.head_dim)
        if module.q_norm is not None:
            q, k = exact_rms_norm(q, module.q_norm), exact_rms_norm(k, module.k_norm)
        rope_store = getattr(attn, "rope_store", None)
        if rope_store is not None and q.is_cuda and cos.dtype == q.dtype and not needs_grad(q, k, v):
            # the engine: rotary and the K / V cache write in one launch, the bits of the rotary
            # kernel exact_rotary runs and of the cache store (tests/rollout/test_fused.py)
            n = b * t
            q = rope_store(module.layer_idx, q.reshape(n, module.n_heads, -1), k.reshape(n, module.n_kv, -1),
                           v.reshape(n, module.n_kv, -1), cos.reshape(n, -1), sin.reshape(n, -1))
            out = attn.attend(module.layer_idx, q.view(b, t, module.n_heads, module.head_dim))
        else:
            out = attn(module.layer_idx, exact_rotary(q, cos, sin), exact_rotary(k, cos, sin), v)
        return exact_linear(module.o_proj, out.reshape(b, t, -1))

    def mlp(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if isinstance(module, SparseMoeBlock):
            return exact_moe_block(module, h, exact_dense)
        if not isinstance(module, MLP):
            raise NotImplementedError(f"exact mode runs dense MLPs and MoE blocks, not {type(module).__name__}")
        fused = _fused(module, "_fused_gate_up", h)
        if fused is not None:
            gate_up = _fused_linear(fused, h)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = exact_linear(module.gate_proj, h), exact_linear(module.up_proj, h)
        return exact_linear(module.down_proj, exact_silu_mul(gate, up))


EXACT_OPS = ExactOps()


def exact_engine_ops(model: nn.Module, device: torch.device) -> ExactOps:
    """The engine's ops in exact mode, its model prepared for them: q/k/v and gate/up fused
    into one buffer each (one invariant GEMM: the same bits per column, :func:`_fused`)."""
    from quarl.rollout.fused import fuse_projections, supports_fused

    require_kernels(device)
    if supports_fused(model):
        fuse_projections(model)
    return EXACT_OPS


def exact_ops(ops: TorchOps | CheckpointedOps) -> ExactOps | CheckpointedOps:
    """:data:`EXACT_OPS` in place of the learner's ``ops`` (compiled regions fuse elementwise
    steps the engine rounds one by one), keeping its activation checkpointing."""
    return CheckpointedOps(EXACT_OPS) if isinstance(ops, CheckpointedOps) else EXACT_OPS


def exact_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head of ``model`` on ``hidden [..., H]`` through the batch-invariant GEMM (no gradient)."""
    return dense_gemm(hidden, model.lm_head_weight).view(*hidden.shape[:-1], -1)


def packed_lengths(attention_mask: torch.Tensor | None, seq_ids: torch.Tensor | None, shape: torch.Size,
                   right_padded: bool | None) -> list[int]:
    """The lengths of the runs of tokens that attend among themselves in a ``[B, T]`` batch,
    row after row: a whole row where the batch is right-padded and not packed (padding comes
    after every real token: causal attention keeps it out of theirs), else each row's runs of
    equal (sequence id, real) (a host sync; left padding is a run of its own)."""
    b, t = shape
    real = None if attention_mask is None else attention_mask.bool()
    if seq_ids is None and (real is None or right_padded
                            or (right_padded is None and bool((real[:, 1:] <= real[:, :-1]).all()))):
        return [t] * b
    key = torch.zeros(b, t, dtype=torch.int64) if seq_ids is None else seq_ids.detach().cpu().long() * 2
    if real is not None:
        key = key + real.cpu().long()
    lengths = []
    for row in key.tolist():
        run = 1
        for prev, cur in zip(row, row[1:]):
            if cur == prev:
                run += 1
            else:
                lengths.append(run)
                run = 1
        lengths.append(run)
    return lengths


def exact_batch_attention(
    input_ids: torch.Tensor, mode: ExactMode, attention_mask: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None, kv_quant: str | None = None, right_padded: bool | None = None,
) -> tuple[torch.Tensor, AttnFn]:
    """Positions ``[B, T]`` and the learner's exact attention for a padded and/or packed batch
    (the arguments of :func:`~quarl.model.transformer.batch_attention`): the invariant kernel
    over the batch's runs (:func:`packed_lengths`) paged as the engine's cache; with gradients
    on, the backward recomputes :func:`batch_attention`'s SDPA (``kv_quant``: its fp8 K / V
    rounding, straight through)."""
    positions, ref_attn = batch_attention(input_ids, attention_mask, seq_ids=seq_ids, kv_quant=kv_quant,
                                          right_padded=right_padded)
    lengths = packed_lengths(attention_mask, seq_ids, input_ids.shape, right_padded)
    fast = _varlen(lengths, mode, page_layout(lengths, mode.page, input_ids.device))  # (one layout for every layer)

    def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return invariant_or_recomputed(fast, lambda *qkv: ref_attn(layer_idx, *qkv), q, k, v)

    return positions, attn


def _varlen(lengths: list[int], mode: ExactMode, layout: PageLayout) -> Callable[..., torch.Tensor]:
    def fast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, hq, d = q.shape
        out = invariant_varlen_attention(q.reshape(b * t, hq, d), k.reshape(b * t, -1, d), v.reshape(b * t, -1, d),
                                         lengths, d**-0.5, mode.page, mode.kv_fp8, layout)
        return out.view(b, t, hq, d)

    return fast
