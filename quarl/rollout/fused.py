"""Fused elementwise kernels for the engine's GPU forward (fewer, larger launches).

A decode step of a small model at batch 256 is dominated by dozens of tiny elementwise
launches per layer (RMSNorm's six, rotary's ten, SiLU-and-mul, residual adds). These
kernels do each group in one pass and reproduce the reference's bf16 rounding steps
(``quarl.model.transformer``): RMSNorm in float32 then cast, then times the weight;
rotary as ``bf16(bf16(x*cos) + bf16(rot(x)*sin))``; ``bf16(bf16(silu(g)) * u)``; residual
adds in the activation dtype. Results agree with the reference to about one bf16 ulp
(reduction order and the compiler's float handling differ; measured on H200: rotary
outputs differ by 1 ulp in a few elements). :func:`fused_hidden_states` is the
model's ``hidden_states`` rewritten over them, for the engine's GPU path only; the
CPU path and the learner keep the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from quarl.model.transformer import AttnFn, Transformer


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * norm(x)`` over the last dim; with ``residual``: ``s = x + residual``
    is written back into ``residual`` and ``weight * norm(s)`` returned."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    n = shape[-1]
    block = triton.next_power_of_2(n)
    if residual is not None:
        r2 = residual.view(-1, n)
        _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, out, r2, n, eps, x2.stride(0), r2.stride(0), out.stride(0),
                                        HAS_RES=True, BLOCK=block, num_warps=min(8, max(1, block // 256)))
    else:
        _rmsnorm_kernel[(x2.shape[0],)](x2, x2, weight, out, x2, n, eps, x2.stride(0), x2.stride(0), out.stride(0),
                                        HAS_RES=False, BLOCK=block, num_warps=min(8, max(1, block // 256)))
    return out.view(shape)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = heads < n_heads
    dmask = d < HALF
    m = hmask[:, None] & dmask[None, :]
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    # out[:half] = x1*c1 + (-x2)*s1 ; out[half:] = x2*c2 + x1*s2, each product rounded as in torch
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    obase = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(obase, y1, mask=m)
    tl.store(obase + HALF, y2, mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[N, H, D]`` (any strides with unit last), cos/sin ``[N, D]`` in x's dtype -> new ``[N, H, D]``."""
    n, h, d = x.shape
    out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(n,)](x, cos, sin, out, h, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                       HALF=d // 2, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2),
                       num_warps=4)
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(dt), mask=mask)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` with the reference's rounding (g, u ``[..., I]``)."""
    n = g.shape[-1]
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
    out = torch.empty_like(g2)
    block = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0), out.stride(0),
                                                            BLOCK=block, num_warps=4)
    return out.view(g.shape)


class FusedLinear:
    """One GEMM standing in for several linears that read the same input.

    ``weight`` is the ``[sum N, K]`` buffer (a tensor for plain linears, a
    ``QuantizedWeight`` for quantized ones) whose row blocks are the modules' own
    parameters/buffers, so loading a module's weights by name writes straight into it.
    """

    def __init__(self, weight, bias: torch.Tensor | None, splits: list[int]) -> None:
        self.weight, self.bias, self.splits = weight, bias, splits

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.Tensor):
            return F.linear(x, self.weight, self.bias)
        from quarl.quant import ops

        return ops.quant_linear(x, self.weight, self.bias)


def _concat_bias_as_views(mods: list[nn.Module]) -> torch.Tensor | None:
    if mods[0].bias is None:
        return None
    bias = torch.cat([m.bias.detach() for m in mods], 0)
    row = 0
    for m in mods:
        n = m.out_features
        m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return bias


def _concat_as_views(mods: list[nn.Linear]) -> FusedLinear:
    """One ``[sum N, K]`` weight (and bias) whose row blocks become the modules' parameters.

    The modules keep their names and shapes, so in-place weight loading writes straight
    into the fused buffer and one GEMM serves them all.
    """
    weight = torch.cat([m.weight.detach() for m in mods], 0)
    row = 0
    for m in mods:
        n = m.out_features
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        row += n
    return FusedLinear(weight, _concat_bias_as_views(mods), [m.out_features for m in mods])


def _concat_quantized_as_views(mods: list) -> FusedLinear:
    """The ``QuantLinear`` version: every packed tensor (codes, per-row scales, zero points)
    is concatenated along N and each module's buffers become views of its row block.
    The modules are told their fused owner and row offset, so that an in-place load into
    one of them also refreshes what kernels derive from the fused weight (the w4 fragment
    copy) for those rows."""
    from quarl.quant.qweight import QuantizedWeight

    fields = mods[0]._fields
    tensors = {f: torch.cat([getattr(m, f) for m in mods], 0) for f in fields}
    total = sum(m.out_features for m in mods)
    fused = QuantizedWeight(mods[0].scheme, (total, mods[0].in_features), **tensors)
    group = FusedLinear(fused, _concat_bias_as_views(mods), [m.out_features for m in mods])
    row = 0
    for m in mods:
        n = m.out_features
        for f in fields:
            setattr(m, f, tensors[f][row : row + n])
        m._fused_owner = (fused, row)
        row += n
    return group


def _fusable(mods: list[nn.Module]) -> str | None:
    """"plain", "quant" or None (mixed types, schemes, biases, or a per-tensor scale)."""
    if len({m.bias is None for m in mods}) != 1:
        return None
    if all(type(x) is nn.Linear for x in mods):
        return "plain"
    from quarl.quant.linear import QuantLinear

    if not all(type(x) is QuantLinear for x in mods):
        return None
    first = mods[0]
    if any(m.scheme != first.scheme or m.in_features != first.in_features for m in mods):
        return None
    if "global_scale" in first._fields:  # nvfp4: one tensor scale per module, not per row
        return None
    return "quant"


def fuse_projections(model: Transformer) -> int:
    """Back q/k/v and gate/up of each layer by one buffer each.

    Decode at rollout batch sizes is launch- and tile-bound on these small GEMMs: one
    ``[q+k+v]`` and one ``[2 I]`` product per layer replace five. Plain linears and
    ``QuantLinear`` groups of one scheme are fused (the quantized formats here keep their
    scales per output row, so concatenating rows gives the same products); nvfp4 (one
    tensor scale per module) and mixed groups are left alone. Returns the number of
    fused groups.
    """
    count = 0
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        groups = (("qkv", a, [a.q_proj, a.k_proj, a.v_proj]), ("gate_up", m, [m.gate_proj, m.up_proj]))
        for name, owner, mods in groups:
            if hasattr(owner, f"_fused_{name}"):
                count += 1
                continue
            kind = _fusable(mods)
            if kind is None:
                continue
            setattr(owner, f"_fused_{name}", _concat_as_views(mods) if kind == "plain" else _concat_quantized_as_views(mods))
            count += 1
    return count


def supports_fused(model: Transformer) -> bool:
    cfg = model.config
    return cfg.hidden_act == "silu" and cfg.head_dim % 2 == 0


def fused_hidden_states(model: Transformer, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
    """``model.hidden_states`` over the fused kernels (same weights, same rounding steps)."""
    x = model.embed_tokens(input_ids)
    b, t, hidden = x.shape
    cos, sin = model.rotary(positions, x.dtype)
    cos, sin = cos.reshape(b * t, -1), sin.reshape(b * t, -1)
    residual = x.reshape(b * t, hidden).clone()
    h = None
    for i, layer in enumerate(model.layers):
        if h is None:
            h = rmsnorm(residual, layer.input_layernorm.weight, layer.input_layernorm.eps)
        a = layer.self_attn
        fused_qkv = getattr(a, "_fused_qkv", None)
        if fused_qkv is not None:
            qkv = fused_qkv(h)
            nq, nkv = a.n_heads * a.head_dim, a.n_kv * a.head_dim
            q = qkv[:, :nq].view(b * t, a.n_heads, a.head_dim)
            k = qkv[:, nq : nq + nkv].view(b * t, a.n_kv, a.head_dim)
            v = qkv[:, nq + nkv :].view(b * t, a.n_kv, a.head_dim)
        else:
            q = a.q_proj(h).view(b * t, a.n_heads, a.head_dim)
            k = a.k_proj(h).view(b * t, a.n_kv, a.head_dim)
            v = a.v_proj(h).view(b * t, a.n_kv, a.head_dim)
        if a.q_norm is not None:
            q = rmsnorm(q, a.q_norm.weight, a.q_norm.eps)
            k = rmsnorm(k, a.k_norm.weight, a.k_norm.eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = attn(a.layer_idx, q.view(b, t, a.n_heads, a.head_dim), k.view(b, t, a.n_kv, a.head_dim),
                   v.reshape(b, t, a.n_kv, a.head_dim))
        o = a.o_proj(out.reshape(b * t, -1))
        h = rmsnorm(o, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual)
        mlp = layer.mlp
        fused_gu = getattr(mlp, "_fused_gate_up", None)
        if fused_gu is not None:
            gu = fused_gu(h)
            inter = gu.shape[-1] // 2
            m = mlp.down_proj(silu_mul(gu[:, :inter], gu[:, inter:]))
        else:
            m = mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        nxt = model.layers[i + 1].input_layernorm if i + 1 < len(model.layers) else model.norm
        h = rmsnorm(m, nxt.weight, nxt.eps, residual)
    return h.view(b, t, hidden)
