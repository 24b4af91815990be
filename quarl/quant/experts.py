"""Quantized MoE experts: the engine's :class:`QuantExperts` and the aligned learner's :class:`QATExperts`.

A :class:`~quarl.model.moe.SparseMoeBlock`'s experts are two stacked weights, ``gate_up_proj
[E, 2I, H]`` and ``down_proj [E, H, I]`` (:class:`~quarl.model.moe.Experts`). Each is quantized
as the ``[E * N, K]`` view of the stack (``quantize_weight(w.reshape(E * N, K), scheme)``):
every scheme but nvfp4 scales per output row or per group of ``G`` along a row, so that is
each expert quantized on its own with the scheme's group layout, and the packed tensors
(codes ``[E * N, K']``, scales ``[E * N]`` or ``[E * N, Kp / G]``, zero points) hold one
expert per block of ``N`` rows. K is zero-padded to a multiple of ``PACK_K`` by the sub-byte
formats, as for the dense linears (the padding quantizes to exact zeros), so an expert width
that is not a multiple of the group size is taken as the dense path takes it. nvfp4's
per-tensor scale would be one scale for all experts of a projection, not one per expert:
:func:`check_expert_scheme` refuses it (and any scheme with a per-tensor scale).

One function runs a projection of all experts on rows sorted by expert
(:func:`grouped_quant_linear`), in one of two ways:

* the grouped kernel (:mod:`quarl.quant.kernels.moe_gemm`) for the engine's int4 group
  schemes (w4a16, w4a16-asym) and 8-bit per-channel ones (w8a8-int8 / fp8, on the rows as
  the GEMM sees them) on bf16 / fp16 rows: always under the Triton backend
  (``quarl.quant.ops.use_backend("triton")``; the CPU tests run it in the interpreter), and
  on a GPU under ``auto`` where it beats the path below, by the rule on the average rows per
  expert (:func:`quarl.quant.kernels.moe_rules.kernel_wins`, measured on an H100). It reads
  the packed experts directly and dequantizes tiles in registers (the same bf16 / fp16 weight
  values as the dequantized path, summed in fp32 in another order). Not for the learner's
  :class:`QATExperts` (a ``master`` weight: the aligned learner keeps its dequantized-weight
  grouped GEMM, as the dense w4a16 learner does, so the two sides share weight values, not
  summation order), not for a projection whose owner keeps a dense copy
  (``rollout.engine.dense_weights``: the plain grouped GEMM on it is the fastest at large
  M), and not where autograd needs ``grad_x`` (a LoRA learner's frozen base);
* otherwise the weight dequantized to ``[E, N, K]`` and one grouped GEMM
  (:func:`quarl.model.moe.grouped_linear`); for schemes that quantize activations (W8A8 /
  W4A8) the rows are first quantized per token with the dense linears' quantizer
  (:func:`quarl.quant.ops.quantize_input`) and the GEMM runs on them as the GEMM sees them
  (codes times scales). On CUDA the GEMM runs in the activations' dtype (``F.grouped_mm``
  with the expert offsets on the device); elsewhere (the CPU, where the reference kernels
  run) in float64, rounded once to the activations' dtype, as
  :func:`~quarl.quant.reference.codes_linear` sums the dense W8A8 GEMM: a row's value then
  does not depend on how many rows the GEMM has, so the engine's decode steps and the
  learner's batches agree bit for bit on the CPU.

Neither syncs with the host (the expert offsets stay on the device), so CUDA graphs capture
both.

The engine's :class:`QuantExperts` holds the packed tensors only, as buffers of one
:class:`PackedExperts` per projection (``experts.gate_up_proj.qdata``, ``.scales``, ...: the
state dict reads as a :class:`~quarl.quant.linear.QuantLinear`'s does), loaded in place
(storage never reallocated). Its forward is differentiable in ``x`` and the gate weights (a
LoRA learner's frozen base), never in the codes.

The learner's :class:`QATExperts` wraps the :class:`~quarl.model.moe.Experts`' own
Parameters (same names: checkpoints, optimizer states and sharding are unchanged), quantizes
them once per weight version, and runs :func:`grouped_quant_linear` on those codes: the
engine's function on the engine's tensors, so both give the same bits for the same inputs,
except where the engine runs the grouped kernel (the same weight values, summed in fp32 in
another order than the learner's grouped GEMM).
The backward is straight-through: ``grad_x`` through the dequantized weight, ``grad_W`` of
each expert ``grad_y^T @ x_seen`` (``x_seen`` the rows as the GEMM saw them: the quantized
and dequantized activations for W8A8 / W4A8).
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.moe import Experts, grouped_linear, run_experts, sort_by_expert
from quarl.quant import ops
from quarl.quant.kernels.moe_rules import kernel_wins, moe_kernel_supports
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight, empty_quantized, quantize_weight
from quarl.quant.scheme import QuantScheme, get_scheme

PROJECTIONS = ("gate_up_proj", "down_proj")
EXCLUDE_HINT = "layers.*.mlp.experts"


def check_expert_scheme(scheme: QuantScheme, name: str = "experts") -> None:
    """Refuse a scheme whose weights cannot be quantized per expert in the stacked layout
    (a per-tensor scale: nvfp4), naming the layer ``name`` and the fix."""
    if scheme.per_tensor_scale:
        raise ValueError(
            f"{name}: {scheme.name} has a per-tensor scale (one fp32 scale for a whole weight), which the stacked "
            f"MoE experts cannot keep per expert; leave the experts unquantized (quant.exclude: "
            f"['{EXCLUDE_HINT}']) or pick a scheme that scales per row or group (e.g. mxfp4, w4a16)")


def expert_shapes(experts: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{projection: (E, N, K)}`` of an experts module (plain, packed or QAT)."""
    e, i, h = experts.num_experts, experts.intermediate_size, experts.hidden_size
    return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the grouped GEMM sums in (module docstring): x's on CUDA, float64 elsewhere."""
    return x.dtype if x.device.type == "cuda" else torch.float64


class _StraightThrough(torch.autograd.Function):
    """``value`` itself (a view, no copy) in the forward; the gradient goes to ``source``
    (same shape) in the backward, cast to its dtype: the straight-through estimator of a
    rounding step whose result ``value`` was made without autograd."""

    @staticmethod
    def forward(ctx, value, source):  # type: ignore[override]
        ctx.source_dtype = source.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, grad.to(ctx.source_dtype)


def _dequantized(qw: QuantizedWeight, num_experts: int, dtype: torch.dtype,
                 repacked: RepackCache | None) -> torch.Tensor:
    """``qw`` (``[E * N, K]``) dequantized to ``[E, N, K]`` in ``dtype`` (no autograd)."""
    with torch.no_grad():
        w = ops.dequantize(qw, dtype) if repacked is None else repacked.dequantized(qw, dtype, ops.dequantize)
    return w.view(num_experts, qw.out_features // num_experts, qw.in_features)


def seen_rows(rows: torch.Tensor, act_format: str, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as the GEMM sees them, in ``dtype``: themselves for weight-only schemes, else
    their per-token codes times scales (the dense linears' quantizer), with a straight-through
    gradient to ``rows``."""
    if act_format == "none":
        return rows.to(dtype)
    with torch.no_grad():
        _, _, seen = ops.quantize_input(rows.detach().contiguous(), act_format, dtype)
    if rows.requires_grad and torch.is_grad_enabled():
        seen = _StraightThrough.apply(seen, rows)
    return seen


def _grouped_kernel_applies(rows: torch.Tensor, qw: QuantizedWeight, num_experts: int,
                            repacked: RepackCache | None, master: torch.Tensor | None,
                            pairs: int | None = None) -> bool:
    """Whether :func:`grouped_quant_linear` runs the grouped kernel: a scheme it reads
    (int4 groups, 8-bit per channel), bf16 / fp16 rows on the fast path, no learner
    ``master``, no dense copy kept by the owner, and no gradient wanted through the rows (the
    kernel has no backward). ``pairs``: the GEMM's row count where it is not ``rows``' (the
    fused gather reads each token's row once for its k pairs)."""
    if master is not None or (repacked is not None and repacked.dense):
        return False
    if not moe_kernel_supports(qw.scheme):
        return False
    if rows.dtype not in (torch.bfloat16, torch.float16) or not ops.uses_fast_path(rows):
        return False
    if rows.requires_grad and torch.is_grad_enabled():
        return False
    if rows.is_cuda and ops.get_backend() != "triton":
        # `auto` on a GPU: the kernel where it beats dequantize + grouped GEMM (few rows per
        # expert: decode), by the measured rule; `use_backend("triton")` always runs it
        return kernel_wins(qw.scheme, rows.shape[0] if pairs is None else pairs, num_experts)
    return True


def grouped_quant_linear(rows: torch.Tensor, qw: QuantizedWeight, offsets: torch.Tensor, num_experts: int,
                         repacked: RepackCache | None = None, master: torch.Tensor | None = None) -> torch.Tensor:
    """One projection of all experts on ``rows [M, K]`` sorted by expert (expert ``e`` owns rows
    ``offsets[e-1]:offsets[e]``, :func:`~quarl.model.moe.sort_by_expert`): ``[M, N]`` in rows'
    dtype, ``rows_e @ deq(W_e)^T`` with the rows quantized per token first for W8A8 / W4A8.

    ``qw``: the projection's ``[E * N, K]`` quantized weight; ``repacked``: the owner's cache of
    its dequantized form (None: made for this call); ``master`` (``[E, N, K]``, the learner's):
    the parameter that gets the straight-through gradient of the dequantized weight.

    Runs the grouped kernel where :func:`_grouped_kernel_applies` (module docstring: the
    engine's int4 / 8-bit experts on the fast path), else the dequantized weight and one
    grouped GEMM; both on the rows as the GEMM sees them."""
    cdt = _compute_dtype(rows)
    if _grouped_kernel_applies(rows, qw, num_experts, repacked, master):
        from quarl.quant.kernels.moe_gemm import grouped_gemm

        return grouped_gemm(seen_rows(rows, qw.scheme.act_format, rows.dtype), offsets, qw, num_experts)
    w = _dequantized(qw, num_experts, cdt, repacked)
    if master is not None and master.requires_grad and torch.is_grad_enabled():
        w = _StraightThrough.apply(w, master)
    x = seen_rows(rows, qw.scheme.act_format, cdt)
    return grouped_linear(x.contiguous(), w, offsets).to(rows.dtype)


def experts_forward(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, intermediate_size: int,
                    weights_of: dict[str, QuantizedWeight], repacked: dict[str, RepackCache] | None = None,
                    masters: dict[str, torch.Tensor] | None = None, lora=None) -> torch.Tensor:
    """:meth:`quarl.model.moe.Experts.forward` over quantized weights (``weights_of``: the
    ``[E * N, K]`` :class:`QuantizedWeight` of each projection): x ``[N, H]``, expert_ids
    ``[N, k]``, weights ``[N, k]`` -> ``[N, H]``. The same sort, gathers and fixed-order sum over
    the slots as the bf16 experts; each projection is :func:`grouped_quant_linear`, plus its
    adapter's term where ``lora`` (enabled :class:`~quarl.model.lora.ExpertsLoRA`) is given.
    Where the grouped kernel runs both projections (no adapters), the steps around them are
    fused into it (:func:`_fused_experts`)."""
    num_experts = weights_of["gate_up_proj"].out_features // (2 * intermediate_size)
    cache = repacked or {}
    master = masters or {}
    pairs = expert_ids.numel()
    if lora is None and weights.dtype == x.dtype and all(
            _grouped_kernel_applies(x, weights_of[p], num_experts, cache.get(p), master.get(p), pairs)
            for p in PROJECTIONS):
        return _fused_experts(x, expert_ids, weights, num_experts, weights_of)

    def project(rows: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        return grouped_quant_linear(rows, weights_of[name], offsets, num_experts, cache.get(name), master.get(name))

    return run_experts(x, expert_ids, weights, num_experts, intermediate_size, project, lora)


def _fused_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                   weights_of: dict[str, QuantizedWeight]) -> torch.Tensor:
    """:func:`~quarl.model.moe.run_experts`'s steps with the grouped kernel's fusions
    (:func:`quarl.quant.kernels.moe_gemm.grouped_gemm`): the gate/up GEMM reads each pair's
    token row of x in place (no gathered copy) and ends in SiLU-and-mul; the down GEMM writes
    each pair's row back to its (token, slot) position times its routing weight; the sum over
    the slots is the unfused one. The same roundings as the unfused path, step by step
    (W8A8: x's rows quantized per token once, which is each gathered copy's quantization)."""
    from quarl.quant.kernels.moe_gemm import grouped_gemm

    n, k = expert_ids.shape
    order, offsets = sort_by_expert(expert_ids, num_experts)
    gate_up, down = weights_of["gate_up_proj"], weights_of["down_proj"]
    hidden = grouped_gemm(seen_rows(x, gate_up.scheme.act_format, x.dtype), offsets, gate_up, num_experts,
                          gated=True, order=order, slots=k)
    per_slot = grouped_gemm(seen_rows(hidden, down.scheme.act_format, x.dtype), offsets, down, num_experts,
                            order=order, route_weights=weights.reshape(-1))
    return per_slot.view(n, k, -1).sum(dim=1)


def _enabled(experts: nn.Module):
    """The experts' LoRA adapters while enabled, else None."""
    lora = getattr(experts, "lora", None)
    return lora if lora is not None and lora.enabled else None


class PackedExperts(nn.Module):
    """The packed tensors of one projection of all experts (``[E * N, K]`` quantized), as
    buffers (``qdata``, ``scales``, ``zeros``) whose storage never moves. Not a linear: the
    :class:`QuantExperts` that owns it runs it. (No ``qweight`` / ``load_quantized`` names, so
    that code looking for packed linears, such as LoRA's, does not take it for one.)"""

    def __init__(self, num_experts: int, out_features: int, in_features: int, scheme: QuantScheme,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        self.scheme = scheme
        empty = empty_quantized(scheme, num_experts * out_features, in_features, device=device, dtype=dtype)
        self._fields = tuple(empty.tensors())
        for name, t in empty.tensors().items():
            self.register_buffer(name, t)
        self.repacked = RepackCache()  # the dequantized weight: per call (or a dense copy the engine asks for)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)

    @property
    def packed(self) -> QuantizedWeight:
        """A view of the buffers as the ``[E * N, K]`` quantized weight (no copy)."""
        return QuantizedWeight(self.scheme, (self.num_experts * self.out_features, self.in_features),
                               **{f: getattr(self, f) for f in self._fields})

    def as_packed(self, value: QuantizedWeight | torch.Tensor, name: str = "experts") -> QuantizedWeight:
        """A published value for this projection as a :class:`QuantizedWeight`: a tensor (``[E, N, K]``
        or ``[E * N, K]``) is quantized with the scheme first."""
        if isinstance(value, QuantizedWeight):
            return value
        e, n, k = self.shape
        if tuple(value.shape) not in ((e, n, k), (e * n, k)):
            raise ValueError(f"{name}: published shape {tuple(value.shape)} vs experts {(e, n, k)}")
        return quantize_weight(value.reshape(e * n, k).to(self.qdata.device), self.scheme)

    @torch.no_grad()
    def copy_from(self, value: QuantizedWeight | torch.Tensor) -> None:
        """Copy ``value`` into the buffers in place (checked first) and refresh derived layouts."""
        target = self.packed
        target.copy_(self.as_packed(value))
        self.repacked.refresh(target)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, out_features={self.out_features}, in_features={self.in_features}, "
                f"scheme={self.scheme.name}")


class QuantExperts(nn.Module):
    """The engine's quantized experts (module docstring): ``gate_up_proj`` and ``down_proj``
    are :class:`PackedExperts`; ``forward(x, expert_ids, weights)`` as :class:`Experts`'."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, scheme: QuantScheme | str,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
                 name: str = "experts") -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        check_expert_scheme(self.scheme, name)
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, num_experts
        for proj, (e, n, k) in expert_shapes(self).items():
            setattr(self, proj, PackedExperts(e, n, k, self.scheme, device, dtype))
        # buffer names under this module (what a packed export writes as quantized)
        self._fields = tuple(f"{p}.{f}" for p in PROJECTIONS for f in getattr(self, p)._fields)
        self.lora = None  # the experts' LoRA adapters (quarl.model.lora.ExpertsLoRA); a plain attribute until set

    @classmethod
    def from_experts(cls, experts: Experts, scheme: QuantScheme | str, name: str = "experts") -> "QuantExperts":
        w = experts.gate_up_proj
        mod = cls(experts.down_proj.shape[1], experts.intermediate_size, experts.num_experts, scheme, w.device,
                  w.dtype, name)
        mod.load_quantized({p: getattr(experts, p).detach() for p in PROJECTIONS})
        return mod

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """``{projection: [E * N, K] QuantizedWeight}``, views of the buffers."""
        return {p: getattr(self, p).packed for p in PROJECTIONS}

    @torch.no_grad()
    def load_quantized(self, published: dict[str, QuantizedWeight | torch.Tensor]) -> None:
        """Copy published projections (by name; tensors are quantized first) into the buffers
        in place, all checked before any is written."""
        unknown = set(published) - set(PROJECTIONS)
        if unknown:
            raise KeyError(f"no expert projection {sorted(unknown)}; projections: {PROJECTIONS}")
        pairs = []
        for proj, value in published.items():
            holder = getattr(self, proj)
            pairs.append((holder, holder.packed.copy_pairs(holder.as_packed(value))))
        for holder, copies in pairs:
            for dst, src in copies:
                dst.copy_(src)
            holder.repacked.refresh(holder.packed)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        cache = {p: getattr(self, p).repacked for p in PROJECTIONS}
        return experts_forward(x, expert_ids, weights, self.intermediate_size, self.quantized_weights(), cache,
                               lora=_enabled(self))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, scheme={self.scheme.name}")


class QATExperts(nn.Module):
    """The aligned learner's experts (module docstring): the :class:`Experts`' Parameters
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` as master weights, the engine's
    forward on their codes, straight-through backward."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, scheme: QuantScheme | str,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 name: str = "experts") -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        check_expert_scheme(self.scheme, name)
        self.hidden_size, self.intermediate_size, self.num_experts = hidden_size, intermediate_size, num_experts
        for proj, shape in expert_shapes(self).items():
            p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
            nn.init.normal_(p, std=0.02)
            setattr(self, proj, p)
        self._init_caches()
        self.lora = None

    def _init_caches(self) -> None:
        self._qw: dict[str, QuantizedWeight] = {}
        self._qw_key: dict[str, tuple] = {}
        # the dequantized weights, kept per weight version (False: made at each use,
        # quarl.quant.linear.set_per_use_dequant)
        self.repacked = {p: RepackCache(keep_dequantized=True) for p in PROJECTIONS}

    @classmethod
    def from_experts(cls, experts: Experts, scheme: QuantScheme | str, name: str = "experts") -> "QATExperts":
        """Wrap ``experts``' own Parameters (an optimizer built on them stays valid)."""
        scheme = get_scheme(scheme)
        check_expert_scheme(scheme, name)
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.scheme = scheme
        mod.hidden_size, mod.intermediate_size = experts.down_proj.shape[1], experts.intermediate_size
        mod.num_experts = experts.num_experts
        mod.gate_up_proj, mod.down_proj = experts.gate_up_proj, experts.down_proj
        mod._init_caches()
        mod.lora = getattr(experts, "lora", None)
        return mod

    def to_experts(self) -> Experts:
        """A plain :class:`Experts` over the same Parameters (the swap undone)."""
        plain = Experts.__new__(Experts)
        nn.Module.__init__(plain)
        plain.num_experts, plain.intermediate_size = self.num_experts, self.intermediate_size
        plain.gate_up_proj, plain.down_proj = self.gate_up_proj, self.down_proj
        return plain

    def _key(self, proj: str) -> tuple:
        w = getattr(self, proj)
        return (w._version, w.data_ptr(), w.device, w.dtype)

    @property
    def keep_dequantized(self) -> bool:
        return all(c.keep_dequantized for c in self.repacked.values())

    @keep_dequantized.setter
    def keep_dequantized(self, on: bool) -> None:
        self.drop_dequantized()
        for c in self.repacked.values():
            c.keep_dequantized = on

    def stale(self) -> bool:
        """Whether a master weight changed since its last quantization."""
        return any(p not in self._qw or self._qw_key[p] != self._key(p) for p in PROJECTIONS)

    def quantized_weight(self, proj: str) -> QuantizedWeight:
        """Projection ``proj``'s master quantized as ``[E * N, K]``, made once per weight version."""
        key = self._key(proj)
        if self._qw_key.get(proj) != key or proj not in self._qw:
            w = getattr(self, proj).detach()
            e, n, k = w.shape
            self._qw[proj] = quantize_weight(w.reshape(e * n, k), self.scheme)
            self._qw_key[proj] = key
        return self._qw[proj]

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        return {p: self.quantized_weight(p) for p in PROJECTIONS}

    def publish(self) -> dict[str, QuantizedWeight]:
        """``{projection: QuantizedWeight}``: the tensors the forward ran on (made now if a
        master changed since)."""
        return self.quantized_weights()

    def invalidate(self) -> None:
        """Forget the cached quantized weights (needed after writes through ``.data``)."""
        self._qw, self._qw_key = {}, {}
        self.drop_dequantized()

    def drop_dequantized(self) -> None:
        """Free the dequantized weights kept between forwards (remade at next use)."""
        for c in self.repacked.values():
            c.drop_dequantized()

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        masters = {p: getattr(self, p) for p in PROJECTIONS}
        return experts_forward(x, expert_ids, weights, self.intermediate_size, self.quantized_weights(),
                               self.repacked, masters, lora=_enabled(self))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, scheme={self.scheme.name}")
