"""One readable decoder-only transformer for Llama-3, Qwen2/2.5, Qwen3 and Qwen3-MoE.

Parameter names follow Hugging Face's (``layers.3.self_attn.q_proj.weight`` ...) minus
the ``model.`` prefix, so checkpoints load without a renaming table and the
quantizer can replace linears by their familiar names.

Attention is injected, not owned: every layer computes q/k/v (bias, per-head q/k
norm, rotary embedding) and hands them to an ``attn`` callable
``attn(layer_idx, q, k, v) -> out`` with shapes ``q [B, T, Hq, D]``,
``k, v [B, T, Hkv, D]``, ``out [B, T, Hq, D]``. The training forward passes a masked
SDPA over the batch (padded or packed), the simple generator a KV-cached one, and the
rollout engine its paged kernels; the weights and the math around attention are
shared by all three, which is what keeps sampler and learner aligned.

``Transformer.kv_quant`` (None, or ``"fp8"``) makes the batch forwards (:meth:`forward`,
``quarl.learner.sequence_logprobs``) round K (after rotary) and V as the engine's fp8 KV
cache stores them, with a straight-through gradient (:func:`batch_attention`); the
trainer sets it in ``aligned`` mode with ``rollout.engine.kv_cache_dtype=fp8``.

``Transformer.exact`` (None, or a ``quarl.quant.kernels.invariant_model.ExactMode``): exact
mode, set by the trainer on the engine's model and the learner's alike; the engine and
``quarl.learner.sequence_logprobs`` then run the batch-invariant kernels for every op they
share (``ExactOps`` of that module), so that both get the same bits for a token.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from quarl.model.config import TransformerConfig
from quarl.model.moe import SparseMoeBlock
from quarl.runtime import recomputed_layer

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the HF reference does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))``: the normalisation in float32, rounded to ``x.dtype`` before the scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(cfg: TransformerConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[D/2]`` (float32) and the attention scaling of the rope type."""
    d, base = cfg.head_dim, cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv, 1.0
    kind, factor = sc["rope_type"], float(sc.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        # Llama-3.1: keep high frequencies, divide low ones by `factor`, blend between.
        low_ff, high_ff = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low_ff, inv / factor, inv)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        old_len = float(sc.get("original_max_position_embeddings", cfg.max_position_embeddings))
        beta_fast, beta_slow = float(sc.get("beta_fast", 32.0)), float(sc.get("beta_slow", 1.0))

        def corr_dim(n_rot: float) -> float:
            return (d * math.log(old_len / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        inv_yarn = (inv / factor) * (1 - extrap) + inv * extrap
        att = sc.get("attention_factor")
        if att is None:
            att = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return inv_yarn, float(att)
    raise ValueError(f"unsupported rope type {kind!r}")


class Rotary(nn.Module):
    """Rotary embedding with a cos/sin table grown on demand and indexed by position.

    Indexing a precomputed table (rather than computing cos/sin per call) keeps the
    decode step free of allocations that depend on the position, so it can be
    captured in a CUDA graph once the table is large enough (``ensure``).
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inv, scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attention_scaling = scale
        self.auto_grow = True
        self.register_buffer("cos_table", torch.empty(0, cfg.head_dim), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, cfg.head_dim), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the model; casts do not: ``inv_freq`` and the tables stay float32 (made
        from the float32 frequencies and rounded to the activations' dtype only when indexed),
        so every copy of a model indexes the same values, whichever dtype it was cast to and
        whether its table was grown before or after the cast (an engine's copy grows it to its
        max_model_len; a learner's may have grown it in a float32 warm start)."""
        rows = self.cos_table.shape[0]
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.cfg)[0].to(self.inv_freq.device)
            self.cos_table = self.sin_table = self.inv_freq.new_empty(0, self.cfg.head_dim)
            if rows:
                self.ensure(rows)
        return self

    def ensure(self, length: int) -> None:
        if self.cos_table.shape[0] >= length:
            return
        n = 1 << max(int(length - 1).bit_length(), 8)
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_table = emb.cos() * self.attention_scaling
        self.sin_table = emb.sin() * self.attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[*positions.shape, D]`` in ``dtype``. ``bound``: the caller knows every
        position is below it (the table grows to it without reading positions back)."""
        if self.auto_grow:  # without a bound, a host sync; engines call ensure() once and turn it off
            self.ensure(bound if bound is not None else int(positions.max()) + 1 if positions.numel() else 1)
        return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, T, H, D]``; cos/sin ``[B, T, D]`` (rotate-half convention)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, H]`` -> q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` with rope applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(x.shape[0], x.shape[1], -1))


class MLP(nn.Module):
    """The dense SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``; the residual stream is
    carried by :meth:`Transformer.hidden_states`. ``mlp`` is a dense :class:`MLP`, or in an
    MoE model's sparse layers (``cfg.is_moe_layer``) a :class:`~quarl.model.moe.SparseMoeBlock`."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, layer_idx) if cfg.is_moe_layer(layer_idx) else MLP(cfg)

    def forward(self, ops: "TorchOps", h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttnFn, next_norm: nn.Module, next_consumer: nn.Module | None):
        """``ops.block`` of this layer (:meth:`TorchOps.block`). Run through the module call so
        that hooks on the layer fire (a sharded learner gathers the layer's weights there)."""
        return ops.block(self, h, residual, cos, sin, attn, next_norm, next_consumer)


class DecoderLayers(nn.ModuleList):
    """The decoder layers, run in turn by one call (:meth:`forward`); each through its module
    call, where a sharded learner gathers its weights (:mod:`quarl.learner.sharded`). Names
    stay ``layers.N.*``."""

    def forward(self, ops: "TorchOps", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn,
                final_norm: nn.Module) -> torch.Tensor:
        """The normed output of the last layer for the embeddings ``x``; each layer's block ends
        with the next layer's input norm (the last one's with ``final_norm``)."""
        h, residual = ops.norm(x, self[0].input_layernorm, None, self[0].self_attn)
        for i, layer in enumerate(self):
            last = i + 1 == len(self)
            h, residual = layer(ops, h, residual, cos, sin, attn, final_norm if last else self[i + 1].input_layernorm,
                                None if last else self[i + 1].self_attn)
        return h


class TorchOps:
    """The steps of :meth:`Transformer.hidden_states` as the model's own modules (the
    learner's forward and the reference). The engine's GPU path passes its fused kernels
    (``quarl.rollout.fused.FusedOps``) with the same methods and rounding steps.

    ``norm(x, norm, residual, consumer)`` adds ``x`` to the residual stream (``x`` starts
    it when ``residual`` is None) and returns ``(norm(stream), stream)``; ``consumer`` is
    the module that reads the result (a fused kernel may quantize for it).
    """

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        residual = x if residual is None else residual + x
        return norm(residual), residual

    def attention(self, module: "Attention", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttnFn) -> torch.Tensor:
        return module(h, cos, sin, attn)

    def mlp(self, module: MLP, h: torch.Tensor) -> torch.Tensor:
        return module(h)

    def block(self, layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, attn: AttnFn, next_norm: nn.Module, next_consumer: nn.Module | None):
        """One decoder layer on its normed input ``h``: attention, the residual add and norm,
        the MLP, and the add into the stream normed by ``next_norm`` (the next layer's input
        norm, or the final one). Returns ``(norm(stream), stream)`` as :meth:`norm` does."""
        a = self.attention(layer.self_attn, h, cos, sin, attn)
        h, residual = self.norm(a, layer.post_attention_layernorm, residual, layer.mlp)
        m = self.mlp(layer.mlp, h)
        return self.norm(m, next_norm, residual, next_consumer)


TORCH_OPS = TorchOps()


class CheckpointedOps:
    """Another ops object (:class:`TorchOps`, the learner's compiled ops, ...) whose
    :meth:`block` recomputes in the backward (activation checkpointing,
    ``torch.utils.checkpoint`` without reentrancy): the forward keeps only each layer's
    inputs, its normed input and the residual stream (2 x ``[B, T, H]`` per layer), and
    the backward runs the layer's forward again to rebuild what its own backward needs.
    The recomputation calls the same kernels on the same inputs, so values and gradients
    equal those of ``inner``. Without gradients (log-prob passes under ``no_grad``) the
    blocks run as ``inner`` runs them."""

    def __init__(self, inner: TorchOps) -> None:
        self.inner = inner

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        return self.inner.norm(x, norm, residual, consumer)

    def attention(self, module: "Attention", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  attn: AttnFn) -> torch.Tensor:
        return self.inner.attention(module, h, cos, sin, attn)

    def mlp(self, module: MLP, h: torch.Tensor) -> torch.Tensor:
        return self.inner.mlp(module, h)

    def block(self, layer: DecoderLayer, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, attn: AttnFn, next_norm: nn.Module, next_consumer: nn.Module | None):
        if not torch.is_grad_enabled():
            return self.inner.block(layer, h, residual, cos, sin, attn, next_norm, next_consumer)
        return checkpoint(self._recomputed_block, layer, h, residual, cos, sin, attn, next_norm, next_consumer,
                          use_reentrant=False)

    def _recomputed_block(self, *args):
        with recomputed_layer():  # the first forward and the recomputation alike
            return self.inner.block(*args)


class Transformer(nn.Module):
    """Decoder-only transformer; ``model(input_ids)`` returns logits ``[B, T, V]``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        # K/V rounding of the batch forwards' attention: None, or "fp8" (quarl.quant.kv), the
        # engine's fp8 KV cache seen by an aligned learner. Not a buffer: not in checkpoints.
        self.kv_quant: str | None = None
        # exact mode (module doc): None, or what the learner's exact forward knows of the engine
        self.exact = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in: its RMSNorm weights', which keep it also where a
        sharded learner stores the other weights in float32 (:mod:`quarl.learner.sharded`)."""
        return self.norm.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn,
        ops: TorchOps | CheckpointedOps = TORCH_OPS,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states ``[B, T, H]`` for ``input_ids``/``positions`` ``[B, T]``.
        ``max_position``: a bound on the positions the caller knows (those
        :func:`batch_attention` computes are below T), which spares a host sync."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype, max_position)
        # engine and learner: the same bits into each activation quantizer (not around the engine's
        # Triton kernels, which a CPU test may run interpreted: they take 16/32-bit inputs)
        if x.device.type == "cpu" and x.dtype != torch.float64 and getattr(attn, "backend", None) != "triton" \
                and self.exact is None and quantizes_activations(self.layers):
            attn = float64_attention(attn)
        return self.layers(ops, x, cos, sin, attn, self.norm).view(*input_ids.shape, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of a padded or packed batch.

        ``attention_mask [B, T]`` (1 = real token) handles left or right padding;
        ``seq_ids [B, T]`` marks packed sequences (attention stays within equal ids,
        positions restart at each new id unless ``positions`` is given).
        """
        hidden = self.hidden_states(
            input_ids, *batch_attention(input_ids, attention_mask, positions, seq_ids, kv_quant=self.kv_quant),
            max_position=input_ids.shape[1] if positions is None else None,
        )
        return self.logits(hidden)


def quantizes_activations(module: nn.Module) -> bool:
    """Whether a linear under ``module`` quantizes its input per token (``scheme.act_format``:
    W8A8 / W4A8; the engine's ``QuantLinear`` and the aligned learner's ``QATLinear`` alike)."""
    return any(getattr(getattr(m, "scheme", None), "act_format", "none") != "none" for m in module.modules())


def float64_attention(attn: AttnFn) -> AttnFn:
    """``attn`` on q / k / v cast to float64, its output rounded back to q's dtype once.

    :meth:`Transformer.hidden_states` runs a CPU model whose linears quantize activations this
    way. The engine and the learner call attention on other shapes (the learner: every query of
    a padded batch, causal; the engine: one sequence's prefill under a mask, one query per
    sequence in decode), and in float32 SDPA takes another kernel or blocking per shape: a
    token's output moves by an ulp or so (7e-7 measured). On a real checkpoint (SmolLM2's
    residual streams reach 2e4) that moves a code of the next per-token activation quantizer,
    and over the layers the two sides' log-probs part by O(1) (~1 on SmolLM2-135M in
    W8A8). In float64 the orders differ ~2^-50 apart, far below the final rounding: both sides
    get the same bits unless a value lies that close to a rounding midpoint. (K / V reach a
    float32 cache, or the fp8 quantizer's float32 path, as the same values: float64 holds them
    exactly.) Weight-only and bf16 schemes keep float32: their ulps stay ulps."""

    def exact(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attn(layer_idx, q.double(), k.double(), v.double()).to(q.dtype)

    return exact


def batch_attention(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    kv_quant: str | None = None,
    right_padded: bool | None = None,
) -> tuple[torch.Tensor, AttnFn]:
    """Positions ``[B, T]`` and a masked causal SDPA for a padded and/or packed batch.

    A right-padded batch without packing runs plain causal attention (SDPA's flash kernel).
    ``right_padded``: the caller knows whether the mask is right padding only (the learner's
    batches are); None reads it from the mask (a host sync).

    ``kv_quant="fp8"``: the SDPA sees ``fake_quantize_kv`` of k (rotated) and v
    (:mod:`quarl.quant.kv`), the values an fp8 KV cache gives the engine's attention."""
    positions, attn = _batch_sdpa(input_ids, attention_mask, positions, seq_ids, right_padded)
    if kv_quant is None:
        return positions, attn
    if kv_quant != "fp8":
        raise ValueError(f"kv_quant must be None or 'fp8', got {kv_quant!r}")
    return positions, _with_fake_quantized_kv(attn)


def _with_fake_quantized_kv(attn: AttnFn) -> AttnFn:
    from quarl.quant.kv import fake_quantize_kv

    def fp8_kv_attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attn(layer_idx, q, fake_quantize_kv(k), fake_quantize_kv(v))

    # a caller that rounds K/V itself (the compiled regions, inside the region that makes them)
    # calls the attention underneath
    fp8_kv_attn.kv_quant, fp8_kv_attn.unrounded = "fp8", attn
    return fp8_kv_attn


def _batch_sdpa(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    seq_ids: torch.Tensor | None,
    right_padded: bool | None = None,
) -> tuple[torch.Tensor, AttnFn]:
    b, t = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones(b, t, dtype=torch.long, device=device)
    real = attention_mask.bool()
    seq_ids_given = seq_ids is not None
    if seq_ids is None:
        seq_ids = torch.zeros(b, t, dtype=torch.long, device=device)
    if positions is None:
        # Position of a token = number of real tokens of its sequence before it.
        starts = torch.ones_like(real)
        starts[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
        cum = torch.cumsum(real.long(), dim=1)
        before = cum - real.long()  # real tokens strictly before t
        # `before` never decreases along t, so a running max of its value at segment
        # starts is the count at the start of the current segment.
        base = torch.cummax(torch.where(starts, before, torch.zeros_like(before)), dim=1).values
        positions = (before - base).clamp(min=0)
    if right_padded is None:
        right_padded = bool((real[:, 1:] <= real[:, :-1]).all())
    if not seq_ids_given and right_padded:
        # Right padding only: plain causal attention is exact for every real token (pads come
        # after them), and without an explicit mask SDPA can use its flash kernel.
        def causal_attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return out.transpose(1, 2)

        return positions, causal_attn
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = causal[None] & (seq_ids[:, :, None] == seq_ids[:, None, :]) & real[:, None, :]
    # Rows of padding attend to themselves so SDPA never sees an all-masked row.
    mask = mask | torch.eye(t, dtype=torch.bool, device=device)[None]
    mask = mask[:, None]

    def attn(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)

    return positions, attn
