"""Per-token log-probabilities without materialising full-vocabulary logits.

For a batch of T tokens and a vocabulary of V, keeping ``logits [T, V]`` in float32
for the backward pass costs ``4 T V`` bytes (T = 64k, V = 152k: 39 GB). The autograd
function below walks the tokens in chunks: the forward keeps only the log-sum-exp
and the target logit of each token; the backward recomputes each chunk's logits and
forms ``d logp / d logits = onehot(target) - softmax`` on the fly. Peak extra memory
is one ``[chunk, V]`` block.

For 16-bit weights on the GPU the logits stay in their own dtype (the GEMM's output,
which the float32 formulation would only cast) and two Triton kernels
(:mod:`quarl.learner.kernels`) do the vocabulary-wide math in float32 in one pass each;
the backward's products with the LM head run on the tensor cores in 16 bit, like every
other layer's backward.

All log-probs are those of ``softmax(logits / temperature)``: the rollout engine
reports the same quantity for the tokens it samples, so the two can be compared.

Exact mode (``model.exact``, :mod:`quarl.quant.kernels.invariant_model`): the forward runs
the batch-invariant kernels the engine runs (the trunk's ops, the attention over the
micro-batch's sequences, the LM head GEMM and the log-softmax), so that each token's
log-prob has the bits the engine reported for it. Under autograd (the update's forward) each
layer runs the invariant ops without gradients for its values and, in the backward, its
ordinary ops (the learner's compiled ones) recomputed from the same inputs for its gradients
(:class:`ValuesThenOrdinaryOps`, reentrant activation checkpointing with two functions): the
log-probs the loss sees are the invariant ones bit for bit, their gradient that of the ordinary
ops at the invariant activations (the same function up to rounding), for one invariant forward,
one recomputation and one backward. The ordinary recomputation routes an MoE layer as the
invariant forward did only where both replay the engine's experts (routing replay); an MoE
policy without it runs the invariant forward under autograd instead, as ``quant.exact_update=
autograd`` does for every model: each linear's backward is the ordinary one on the saved
inputs, the attention, norms and elementwise steps recompute their ordinary forward in the
backward (:mod:`quarl.quant.kernels.invariant_autograd`), so no GEMM runs twice.
"""

from __future__ import annotations

import torch

from quarl.model.transformer import (
    TORCH_OPS,
    CheckpointedOps,
    TorchOps,
    Transformer,
    batch_attention,
    float64_attention,
    quantizes_activations,
)
from quarl.runtime import recomputed_layer


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half/bf16/fp32 inputs, float64 for float64 (reference checks)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_stats(h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, inv_t: float, want_entropy: bool):
    logits = (h @ w.t()).to(_acc_dtype(h)) * inv_t
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, tgt[:, None]).squeeze(-1) - lse
    ent = None
    if want_entropy:
        p = torch.softmax(logits, dim=-1)
        ent = lse - (p * logits).sum(-1)
    return logp, ent


def _forward_outputs(ctx, saved: tuple, inv_t: float, chunk: int, logp: torch.Tensor, ent: torch.Tensor | None):
    """Save what the backward needs; ``(logp, entropy)``, the entropy non-differentiable (or empty)."""
    ctx.save_for_backward(*saved)
    ctx.inv_t, ctx.chunk = inv_t, chunk
    if ent is None:
        return logp, torch.empty(0, device=logp.device)
    ctx.mark_non_differentiable(ent)
    return logp, ent


def use_kernels(hidden: torch.Tensor) -> bool:
    """The fused path: 16-bit hidden states on a CUDA device (Triton present)."""
    from quarl.quant.kernels import triton_available

    return hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and triton_available()


class _FusedTokenLogprob(torch.autograd.Function):
    """Chunked log-probs with 16-bit logits and the Triton kernels (see the module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, want_entropy):  # type: ignore[override]
        from quarl.learner.kernels import logit_stats

        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else None
        for s in range(0, n, chunk):
            lp, ls, e = logit_stats(hidden[s : s + chunk] @ weight.t(), targets[s : s + chunk], inv_t, want_entropy)
            logp[s : s + chunk], lse[s : s + chunk] = lp, ls
            if want_entropy:
                ent[s : s + chunk] = e
        return _forward_outputs(ctx, (hidden, weight, targets, lse), inv_t, chunk, logp, ent)

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):  # type: ignore[override]
        from quarl.learner.kernels import logit_grad_

        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # several chunks add their products in float32; one chunk's product is the gradient as it
        # is (the same rounding, without a float32 copy of the head: 2 GB for a 152k vocabulary)
        several = hidden.shape[0] > ctx.chunk
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w and several else None
        grad_logp = grad_logp.float().contiguous()
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            d = logit_grad_(h @ weight.t(), targets[s : s + ctx.chunk], lse[s : s + ctx.chunk],
                            grad_logp[s : s + ctx.chunk], ctx.inv_t)
            if need_h:
                grad_h[s : s + ctx.chunk] = d @ weight
            if need_w and several:
                grad_w += d.t() @ h
            elif need_w:
                grad_w = d.t() @ h
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


class _ChunkedTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, want_entropy):  # type: ignore[override]
        n = hidden.shape[0]
        acc = _acc_dtype(hidden)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device) if want_entropy else None
        for s in range(0, n, chunk):
            lp, e = _chunk_stats(hidden[s : s + chunk], weight, targets[s : s + chunk], inv_t, want_entropy)
            logp[s : s + chunk] = lp
            if want_entropy:
                ent[s : s + chunk] = e
        return _forward_outputs(ctx, (hidden, weight, targets), inv_t, chunk, logp, ent)

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        inv_t, chunk = ctx.inv_t, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc_dtype(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h, tgt, g = hidden[s : s + chunk], targets[s : s + chunk], grad_logp[s : s + chunk].to(acc)
            logits = (h @ weight.t()).to(acc) * inv_t
            d = -torch.softmax(logits, dim=-1) * g[:, None]
            d.scatter_add_(-1, tgt[:, None], g[:, None])
            d = d * inv_t
            if need_h:
                grad_h[s : s + chunk] = (d.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w += d.t() @ h.to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def _exact_stats(hidden, weight, targets, inv_t: float, chunk: int, want_entropy: bool):
    """``(logp, lse, entropy or None)`` fp32 through the invariant LM head GEMM and log-softmax."""
    from quarl.quant.kernels.invariant import dense_gemm
    from quarl.quant.kernels.invariant_softmax import invariant_token_logprobs

    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if want_entropy else None
    for s in range(0, n, chunk):
        out = invariant_token_logprobs(dense_gemm(hidden[s : s + chunk], weight), targets[s : s + chunk], inv_t,
                                       want_entropy)
        logp[s : s + chunk], lse[s : s + chunk] = out[0], out[1]
        if want_entropy:
            ent[s : s + chunk] = out[2]
    return logp, lse, ent


class _ExactFusedTokenLogprob(_FusedTokenLogprob):
    """Exact mode's forward (the engine's kernels, :func:`_exact_stats`), the fused backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, want_entropy):  # type: ignore[override]
        logp, lse, ent = _exact_stats(hidden, weight, targets, inv_t, chunk, want_entropy)
        return _forward_outputs(ctx, (hidden, weight, targets, lse), inv_t, chunk, logp, ent)


class _ExactChunkedTokenLogprob(_ChunkedTokenLogprob):
    """Exact mode's forward (the engine's kernels, :func:`_exact_stats`), the chunked backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, want_entropy):  # type: ignore[override]
        logp, _, ent = _exact_stats(hidden, weight, targets, inv_t, chunk, want_entropy)
        return _forward_outputs(ctx, (hidden, weight, targets), inv_t, chunk, logp, ent)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    fused: bool | None = None,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ weight.T / temperature)[targets]`` in float32 (float64 for float64 input).

    hidden ``[..., H]``, weight ``[V, H]``, targets ``[...]`` (long) -> logp ``[...]`` and,
    if asked, the entropy ``[...]`` of the same distribution (no gradient). ``fused``
    picks the Triton path (default: :func:`use_kernels`); ``chunk_size`` rows of logits
    are live at a time (default 4096 fused, 1024 otherwise). ``exact``: the forward through
    the batch-invariant LM head and log-softmax (exact mode, module doc; float32 out).
    """
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    fused = use_kernels(h) if fused is None else fused
    if exact:
        fn = _ExactFusedTokenLogprob if fused else _ExactChunkedTokenLogprob
    else:
        fn = _FusedTokenLogprob if fused else _ChunkedTokenLogprob
    chunk = chunk_size or (4096 if fused else 1024)
    logp, ent = fn.apply(h, weight, targets.reshape(-1).contiguous(), 1.0 / temperature, chunk, with_entropy)
    return logp.view(shape), (ent.view(shape) if with_entropy else None)


def _routes_alike(model: Transformer) -> bool:
    """Whether the ordinary forward routes every MoE layer as the invariant one does: a dense
    model; an MoE model whose every layer replays given experts (routing replay)."""
    from quarl.model.moe import SparseMoeBlock

    for m in model.modules():
        if isinstance(m, SparseMoeBlock) and (m.routing is None or not m.routing.replay
                                              or m.layer_idx not in m.routing.replay):
            return False
    return True


def _ordinary_layers(model: Transformer, input_ids, attention_mask, seq_ids, right_padded, ops):
    """``(ops, cos, sin, attn)`` of the ordinary forward of this batch (the learner's ops without
    their checkpointing), for :class:`ValuesThenOrdinaryOps`'s recomputation."""
    positions, attn = batch_attention(input_ids, attention_mask, seq_ids=seq_ids, kv_quant=model.kv_quant,
                                      right_padded=right_padded)
    cos, sin = model.rotary(positions, model.compute_dtype, input_ids.shape[1])
    if (input_ids.device.type == "cpu" and model.compute_dtype != torch.float64
            and getattr(attn, "backend", None) != "triton" and quantizes_activations(model.layers)):
        attn = float64_attention(attn)  # (as Transformer.hidden_states does for the ordinary forward)
    return (ops.inner if isinstance(ops, CheckpointedOps) else ops), cos, sin, attn


class _ValuesThenOrdinary(torch.autograd.Function):
    """One decoder layer's block: forward through the invariant ops without autograd (the
    values, bit for bit the engine's); backward by recomputing the block through the ordinary
    ops from the same inputs and running its backward (as reentrant activation checkpointing
    does: parameter gradients accumulate there). ``params`` only make the outputs require
    gradients where the layer trains."""

    @staticmethod
    def forward(ctx, h, residual, values, ordinary, *params):  # type: ignore[override]
        ctx.ordinary = ordinary
        ctx.save_for_backward(h, residual)
        with torch.no_grad():
            return values(h, residual)

    @staticmethod
    def backward(ctx, grad_h, grad_res):  # type: ignore[override]
        h, residual = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad(), recomputed_layer():
            out = ctx.ordinary(h, residual)
        torch.autograd.backward(out, (grad_h, grad_res))
        return (h.grad, residual.grad, None, None) + (None,) * (len(ctx.needs_input_grad) - 4)


class ValuesThenOrdinaryOps:
    """Ops of exact mode's update forward: each layer's block :class:`_ValuesThenOrdinary` (the
    invariant ops ``exact`` for values, the ordinary ``inner`` on the batch's ordinary rotary and
    attention for gradients); the first norm through ``exact`` (whose RMSNorm recomputes its
    ordinary form in the backward). One forward instead of the invariant one plus a
    checkpointed ordinary one; the gradients are the ordinary ops' at the invariant
    activations, equal to the ordinary path's up to rounding."""

    def __init__(self, exact: TorchOps, inner: TorchOps, cos: torch.Tensor, sin: torch.Tensor, attn) -> None:
        self.exact, self.inner, self.cos, self.sin, self.attn = exact, inner, cos, sin, attn

    def norm(self, x, norm, residual, consumer):
        return self.exact.norm(x, norm, residual, consumer)

    def block(self, layer, h, residual, cos, sin, attn, next_norm, next_consumer):
        def values(a, r):
            return self.exact.block(layer, a, r, cos, sin, attn, next_norm, next_consumer)

        def ordinary(a, r):
            return self.inner.block(layer, a, r, self.cos, self.sin, self.attn, next_norm, next_consumer)

        params = [p for m in (layer, next_norm) for p in m.parameters() if p.requires_grad]
        return _ValuesThenOrdinary.apply(h, residual, values, ordinary, *params)


def sequence_logprobs(
    model: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    ops: TorchOps | CheckpointedOps = TORCH_OPS,
    right_padded: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token: ``out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])``.

    Returns ``[B, T-1]`` (float32). Padded and packed batches as in
    :meth:`Transformer.forward`; positions whose target is padding or belongs to the
    next packed sequence hold meaningless values and must be masked by the caller. ``ops``
    runs the forward's steps (the learner passes :class:`~quarl.learner.compiled_ops.CompiledOps` on CUDA,
    wrapped in :class:`~quarl.model.transformer.CheckpointedOps` with activation checkpointing).
    With ``model.kv_quant = "fp8"`` attention sees K/V rounded as the engine's fp8 KV cache
    stores them (:func:`~quarl.model.transformer.batch_attention`). ``right_padded=True``
    (the learner's batches) spares reading the mask's layout back from the device.
    """
    exact = getattr(model, "exact", None)
    update = exact is not None and torch.is_grad_enabled() and exact.update == "recompute" and _routes_alike(model)
    if exact is not None:  # exact mode (module doc): the engine's kernels, whatever ``ops`` says
        from quarl.quant.kernels.invariant_model import EXACT_OPS, exact_batch_attention, exact_ops

        if update:  # the update's forward: invariant values, each layer's gradient from its ordinary ops
            ordinary = _ordinary_layers(model, input_ids, attention_mask, seq_ids, right_padded, ops)
        positions, attn = exact_batch_attention(input_ids, exact, attention_mask, seq_ids, model.kv_quant,
                                                right_padded)
        ops = ValuesThenOrdinaryOps(EXACT_OPS, *ordinary) if update else exact_ops(ops)
    else:
        positions, attn = batch_attention(input_ids, attention_mask, seq_ids=seq_ids, kv_quant=model.kv_quant,
                                          right_padded=right_padded)
    hidden = model.hidden_states(input_ids, positions, attn, ops, max_position=input_ids.shape[1])[:, :-1]
    return token_logprobs(hidden, model.lm_head_weight, input_ids[:, 1:], temperature, chunk_size, with_entropy,
                          exact=exact is not None)
