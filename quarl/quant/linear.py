"""The two quantized linear modules and the helpers that swap them into a model (publishing: :mod:`.publish`).

* :class:`QuantLinear` (rollout engine): holds only the packed tensors, as buffers
  whose storage never moves, so a CUDA graph captured over it stays valid when new
  weights are loaded with :meth:`QuantLinear.load_quantized`.
* :class:`QATLinear` (learner, QaRL "aligned" mode): holds BF16/FP32 master weights;
  its forward quantizes them and runs the very function ``QuantLinear`` runs
  (:func:`quarl.quant.ops.quant_linear`), so learner and engine logits agree by
  construction. Backward is straight-through:
  ``grad_x = grad_y @ W_deq`` and ``grad_W = grad_y^T @ x_seen`` where ``x_seen`` is the
  input as the forward's GEMM saw it (quantized-dequantized for W8A8/W4A8).
  The ``QuantizedWeight`` made by a forward is cached until the master weight changes
  (tracked through the parameter's version counter and storage pointer; in-place writes
  through ``.data`` bypass the counter, so call :meth:`QATLinear.invalidate` after those)
  and is what :meth:`QATLinear.publish` hands to the engine: no re-quantization.
* Weight-only schemes on the fast path: :class:`QATLinear` runs ``F.linear`` on a leaf
  tensor holding the dequantized weight (made once per weight version) instead of the
  autograd function, at every batch size (:func:`learner_runs_dequantized`). That is the
  engine's own GEMM at prefill-sized M (the ``dequant`` plan of
  :mod:`quarl.quant.kernels.dispatch`); its low-bit kernels at smaller M multiply the same
  bf16 weight values and sum in another order. Autograd's C++ backward runs, and a hook
  moves the leaf's gradient onto the master weight (straight-through). Per micro-batch this
  saves a Python forward and backward per linear, which is what bounds a learner whose
  kernels take tens of microseconds.
* The learner's compiled regions (:mod:`quarl.learner.compiled_ops`) take a linear as data
  (:func:`traceable`): that leaf, or for schemes that quantize activations the engine's
  quantizer (torch ops the compiler fuses) and GEMM (the op ``quarl::quantized_input_gemm``)
  under a straight-through autograd function that the compiler traces into the region's
  backward, so no Python autograd code runs when a region runs.
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from quarl.model.lora import LoRALinear, apply_adapter
from quarl.model.moe import Experts
from quarl.quant import ops
from quarl.quant.dense_leaf import DequantizedLeaf, deferring
from quarl.quant.experts import QATExperts, QuantExperts, check_expert_scheme
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight, concat_quantized, empty_quantized, quantize_weight, quantize_weights
from quarl.quant.scheme import QuantScheme, get_scheme
from quarl.quant.traced import _straight_through, traced_linear  # noqa: F401 (traced_linear runs traced_qat's forms)
from quarl.runtime import saves_nothing_past_the_layer

DEFAULT_INCLUDE = ("layers.*",)


class QuantLinear(nn.Module):
    """Inference linear over packed weights: ``y = quant_linear(x, W_q) + b``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme | str,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = get_scheme(scheme)
        empty = empty_quantized(self.scheme, out_features, in_features, device=device, dtype=dtype)
        self._fields = tuple(empty.tensors())
        for name, t in empty.tensors().items():
            self.register_buffer(name, t)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype),
                                 requires_grad=False) if bias else None
        self.repacked = RepackCache()  # kernel layouts of the weight (w4 fragment order)
        self.learner_path = False  # True: the frozen base of a LoRA learner (forward's docstring)
        self.lora = None  # a LoRA adapter (quarl.model.lora.add_lora); a plain attribute until set

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme | str) -> "QuantLinear":
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, scheme, linear.bias is not None, w.device, w.dtype)
        mod.load_quantized(quantize_weight(w.detach(), mod.scheme))
        if linear.bias is not None:
            mod.bias.data.copy_(linear.bias.detach())
        return mod

    @property
    def qweight(self) -> QuantizedWeight:
        """A view of the buffers (no copy)."""
        return QuantizedWeight(self.scheme, (self.out_features, self.in_features),
                               **{f: getattr(self, f) for f in self._fields})

    @torch.no_grad()
    def load_quantized(self, qw: QuantizedWeight) -> None:
        """Copy published tensors into this module's storage in place.

        The kernel layouts derived from the weight are rebuilt in place too. When the engine
        fused this module with its siblings (``quarl.rollout.fused``), its buffers are a row
        block of the fused weight, whose owner (``_fused_owner = (owner, row)``, the owner
        having ``weight`` and ``repacked``) keeps those layouts: they are refreshed for
        these rows."""
        target, cache, rows = self.layouts()
        was_fresh = cache.is_fresh(target)
        self.qweight.copy_(qw)
        cache.refresh(target, rows if was_fresh else None)

    def layouts(self) -> tuple[QuantizedWeight, RepackCache, tuple[int, int] | None]:
        """``(weight, cache, rows)``: the weight whose kernel layouts hold this module's rows
        (its own, or its fused group's), the cache of those layouts, and this module's rows
        in that weight (None: all of it)."""
        owner = getattr(self, "_fused_owner", None)
        if owner is None:
            return self.qweight, self.repacked, None
        group, row = owner
        return group.weight, group.repacked, (row, row + self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The engine's GEMM on the packed weight, plus the module's LoRA adapter if it has one
        (``self.lora``, :mod:`quarl.model.lora`). With ``learner_path`` set (the frozen base of a
        LoRA learner), the GEMM is :class:`_FrozenQuantMatmul`: differentiable in ``x``."""
        if self.learner_path:
            return apply_adapter(self, x, _FrozenQuantMatmul.apply(x, self.bias, self.qweight, self.repacked))
        ad = getattr(self, "lora", None)
        term = ad.term(x) if ad is not None and ad.enabled else None  # added by the GEMM (its epilogue, where it can)
        return ops.quant_linear(x, self.qweight, self.bias, self.repacked, term)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
                f"bias={self.bias is not None}")


class _FrozenQuantMatmul(torch.autograd.Function):
    """A frozen low-bit linear that the gradient passes through to its input (the base of a
    LoRA learner). Forward: what :class:`QATLinear` runs for the same weight (``F.linear`` over
    the dequantized weight for weight-only schemes on the fast path, the engine's kernel
    otherwise). Backward: ``grad_x = grad_y @ deq(W)`` (straight-through for W8A8). The
    dequantized weight comes from ``repacked``: made per GEMM by default, so a layer's dense
    weight lives only while its GEMM runs and a large base never exists in bf16 as a whole;
    kept through the learner phase where memory allows
    (:func:`~quarl.learner.memory.keep_frozen_bases_dense`)."""

    @staticmethod
    def forward(ctx, x, bias, qw: QuantizedWeight, repacked: RepackCache):  # type: ignore[override]
        ctx.qw, ctx.x_dtype, ctx.repacked = qw, x.dtype, repacked
        if learner_runs_dequantized(x, qw):
            return F.linear(x, repacked.dequantized(qw, x.dtype, ops.dequantize), bias)
        return ops.quant_linear(x, qw, bias, repacked)

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        w = ctx.repacked.dequantized(ctx.qw, grad_y.dtype, ops.dequantize)
        grad_x = (grad_y.reshape(-1, grad_y.shape[-1]) @ w).view(*grad_y.shape[:-1], -1).to(ctx.x_dtype)
        return grad_x, None, None, None


class _QATMatmul(torch.autograd.Function):
    """Forward: the engine's kernel on ``qw``. Backward: straight-through (module docstring).

    ``weights`` are the master weights whose quantized rows ``qw`` stacks (one, or a fused
    group's); each gets its row block of ``grad_W``. For schemes that quantize activations
    the forward quantizes ``x`` once and runs the GEMM on the codes; the quantizer's pass also
    writes ``x`` as the GEMM saw it (codes times scales, in x's dtype), which ``grad_W``
    needs: no dequantizing launch in the backward.

    ``repacked`` None (:func:`set_per_use_dequant`): the weight is dequantized at each use
    and kept by nothing, a weight-only forward on the learner's fast path is ``F.linear`` over
    it (as :func:`_qat_linear`'s leaf path computes), the kernel's layouts are made per call."""

    @staticmethod
    def forward(ctx, x, bias, qw: QuantizedWeight, repacked: RepackCache | None, *weights):  # type: ignore[override]
        ctx.qw, ctx.repacked, ctx.has_bias = qw, repacked, bias is not None
        ctx.sizes, ctx.w_dtypes, ctx.x_dtype = [w.shape[0] for w in weights], [w.dtype for w in weights], x.dtype
        fmt = qw.scheme.act_format
        if fmt == "none":
            ctx.save_for_backward(x)
            if repacked is None and learner_runs_dequantized(x, qw):
                return F.linear(x, ops.dequantize(qw, x.dtype), bias)
            return ops.quant_linear(x, qw, bias, repacked if repacked is not None else RepackCache())
        if any(ctx.needs_input_grad[4:]):  # grad_W needs x as the GEMM saw it: written by the quantizer's pass
            xq, sx, x_seen = ops.quantize_input(x.reshape(-1, x.shape[-1]), fmt, x.dtype)
            ctx.save_for_backward(x_seen)
        else:
            xq, sx = ops.quantize_input(x.reshape(-1, x.shape[-1]), fmt)
        y = ops.quant_linear_quantized_input(xq, sx, qw, bias, x.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):  # type: ignore[override]
        qw: QuantizedWeight = ctx.qw
        gy = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_b = None
        grad_ws: list[torch.Tensor | None] = [None] * len(ctx.sizes)
        if ctx.needs_input_grad[0]:
            w = ops.dequantize(qw, grad_y.dtype) if ctx.repacked is None else \
                ctx.repacked.dequantized(qw, grad_y.dtype, ops.dequantize)
            grad_x = (gy @ w).view(*grad_y.shape[:-1], -1).to(ctx.x_dtype)
        if any(ctx.needs_input_grad[4:]):
            (x_seen,) = ctx.saved_tensors  # (for W8A8 / W4A8 the dequantized codes)
            grad_w = gy.T @ x_seen.reshape(-1, x_seen.shape[-1]).to(gy.dtype)
            grad_ws = [g.to(dt) if need else None for g, dt, need in
                       zip(grad_w.split(ctx.sizes, 0), ctx.w_dtypes, ctx.needs_input_grad[4:])]
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_b = gy.sum(0)
        return (grad_x, grad_b, None, None, *grad_ws)


def learner_runs_dequantized(x: torch.Tensor, qw: QuantizedWeight) -> bool:
    """Whether the learner's aligned forward of ``qw`` on ``x`` is ``F.linear`` over the
    dequantized weight: weight-only schemes wherever the engine's fast kernels run, at every
    batch size. The engine runs that GEMM at prefill-sized M; at decode-sized M its low-bit
    kernels take the same bf16 weight values and sum in another order, and the engine never
    runs the learner's M anyway (it samples each token within a decode batch). One path for
    every M also keeps each compiled layer region of the learner one graph: a short
    micro-batch runs what the long ones run, with nothing compiled at its first use."""
    sc = qw.scheme
    return sc.quantizes_weights and sc.act_format == "none" and ops.uses_fast_path(x)


def _qat_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, repacked: RepackCache,
                leaf: DequantizedLeaf, masters: list[torch.Tensor]) -> torch.Tensor:
    """The QAT forward of master weights ``masters`` stacked as ``qw``: ``F.linear`` on the
    dequantized leaf for weight-only schemes (:func:`learner_runs_dequantized`), else the
    autograd function."""
    if learner_runs_dequantized(x, qw) and leaf.keep:
        return F.linear(x, leaf.get(qw, x.dtype, repacked, masters), bias)
    return _QATMatmul.apply(x, bias, qw, repacked if leaf.keep else None, *masters)


def traced_qat(x: torch.Tensor, qw: QuantizedWeight, bias, repacked: RepackCache, leaf: DequantizedLeaf,
               masters: list[torch.Tensor]) -> tuple | None:
    """The QAT forward of ``masters`` (stacked as ``qw``) on inputs like ``x`` as plain data a
    compiled region runs with :func:`traced_linear` (no Python autograd function inside):
    ``("dense", W_deq, bias)`` where the engine's GEMM is a matmul over the dequantized weight,
    ``("quantized_input", W_deq, bias, qdata, scales, zeros, scheme)`` for W8A8 / W4A8; the
    dequantized leaf carries the gradient to the masters either way. None for the rest
    (the reference kernels off the fast path, per-tensor scales)."""
    sc = qw.scheme
    if not leaf.keep and not leaf.straight_through:  # per-use: the autograd function, outside compiled regions
        return None
    fits = learner_runs_dequantized(x, qw) or (sc.act_format in ("int8", "fp8") and not sc.per_tensor_scale)
    if not fits:
        return None
    w = _straight_through(qw, x.dtype, masters) if not leaf.keep else leaf.get(qw, x.dtype, repacked, masters)
    if learner_runs_dequantized(x, qw):
        return ("dense", w, bias)
    return ("quantized_input", w, bias, qw.qdata, qw.scales, qw.zeros, sc.name)


def traceable(mod: nn.Module, x: torch.Tensor) -> tuple | None:
    """:func:`traced_qat`'s description of a plain ``nn.Linear`` or a :class:`QATLinear`
    on inputs like ``x``, or of a LoRA learner's linear (:func:`_traced_lora`); None for any
    other module or path."""
    if type(mod) is nn.Linear:
        return ("dense", mod.weight, mod.bias)
    if isinstance(mod, QATLinear):
        return traced_qat(x, mod.quantized_weight(), mod.bias, mod.repacked, mod._leaf, [mod.weight])
    if isinstance(mod, (LoRALinear, QuantLinear)):
        return _traced_lora(mod, x)
    return None


def _traced_lora(mod: "LoRALinear | QuantLinear", x: torch.Tensor) -> tuple | None:
    """A LoRA learner's linear as ``("dense", W, bias[, (A, B, scaling)])``: a bf16 base
    (:class:`~quarl.model.lora.LoRALinear`), or a frozen low-bit base whose learner forward is
    ``F.linear`` over its dequantized weight and which either keeps that weight through the
    update (:func:`~quarl.learner.memory.keep_frozen_bases_dense`) or makes it per use where
    nothing the region saves outlives the layer (activation checkpointing, or no gradient:
    otherwise every layer's dense weight would be saved for the backward at once). The frozen
    ``W`` gets no gradient, the adapter's ``A`` and ``B`` do. None for the other paths (W8A8
    bases, per use otherwise)."""
    if isinstance(mod, QuantLinear):
        qw = mod.qweight
        if not (mod.learner_path and learner_runs_dequantized(x, qw)
                and (mod.repacked.keep_dequantized or saves_nothing_past_the_layer())):
            return None
        w = mod.repacked.dequantized(qw, x.dtype, ops.dequantize)
    else:
        w = mod.weight
    ad = getattr(mod, "lora", None)
    if ad is None or not ad.enabled:
        return ("dense", w, mod.bias)
    return ("dense", w, mod.bias, (ad.A, ad.B, ad.scaling))


class QATLinear(nn.Module):
    """Training linear with master weights and the engine's quantized forward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme | str,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = get_scheme(scheme)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self._init_caches()

    def _init_caches(self) -> None:
        self._qw: QuantizedWeight | None = None
        self._qw_key: tuple | None = None
        self._leaf = DequantizedLeaf()
        self.repacked = RepackCache(keep_dequantized=True)  # kernel layouts of the quantized weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme | str) -> "QATLinear":
        """Wrap ``linear``'s own Parameters (an optimizer built on them stays valid)."""
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        mod.scheme = get_scheme(scheme)
        mod.weight = linear.weight
        mod.bias = linear.bias
        mod._init_caches()
        return mod

    def _key(self) -> tuple:
        w = self.weight
        return (w._version, w.data_ptr(), w.device, w.dtype)

    def invalidate(self) -> None:
        """Forget the cached quantized weight (needed after writes through ``.data``)."""
        self._qw, self._qw_key = None, None
        self.drop_dequantized()

    def drop_dequantized(self) -> None:
        """Free the dequantized weight kept between forwards (remade at next use)."""
        self.repacked.drop_dequantized()
        self._leaf.drop()

    def quantized_weight(self) -> QuantizedWeight:
        """The quantized master weight, made once per weight version."""
        key = self._key()
        if self._qw is None or self._qw_key != key:
            self._qw = quantize_weight(self.weight.detach(), self.scheme)
            self._qw_key = key
        return self._qw

    def publish(self) -> QuantizedWeight:
        """The tensors the forward ran on (made now if the weight changed since)."""
        return self.quantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _qat_linear(x, self.quantized_weight(), self.bias, self.repacked, self._leaf, [self.weight])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
                f"bias={self.bias is not None}")


class QATGroup:
    """Several :class:`QATLinear` that read one input (a layer's q/k/v, its gate/up), run as
    one GEMM in the learner as the engine fuses them: their quantized weights stacked by
    rows (made when one of them changes), the input quantized once, one autograd node; each
    master weight gets its row block of the gradient. The values are those of the members
    run one by one up to the GEMM's summation order, which the engine's fused GEMM shares.
    Not a module: it owns no parameters (the members keep theirs, names and checkpoints
    unchanged)."""

    def __init__(self, mods: list[QATLinear]) -> None:
        self.mods = list(mods)
        self.sizes = [m.out_features for m in self.mods]
        self.repacked = RepackCache(keep_dequantized=True)
        self._leaf = DequantizedLeaf(keep=all(m._leaf.keep for m in self.mods),
                                      straight_through=all(m._leaf.straight_through for m in self.mods))
        self._qw: QuantizedWeight | None = None
        self._parts: list[QuantizedWeight] = []

    def quantized_weight(self) -> QuantizedWeight:
        parts = [m.quantized_weight() for m in self.mods]
        if self._qw is None or any(a is not b for a, b in zip(parts, self._parts)):
            self._qw, self._parts = concat_quantized(parts), parts
        return self._qw

    def drop_dequantized(self) -> None:
        self.repacked.drop_dequantized()
        self._leaf.drop()

    def stacked(self, x: torch.Tensor) -> torch.Tensor:
        """The members' outputs side by side ``[..., sum N_i]`` (one tensor, one gradient)."""
        bias = None if self.mods[0].bias is None else torch.cat([m.bias for m in self.mods])
        return _qat_linear(x, self.quantized_weight(), bias, self.repacked, self._leaf, [m.weight for m in self.mods])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.stacked(x).split(self.sizes, -1))

    def traced(self, x: torch.Tensor) -> tuple | None:
        """:func:`traced_qat` of the stacked weight (the biases as a tuple)."""
        bias = None if self.mods[0].bias is None else tuple(m.bias for m in self.mods)
        return traced_qat(x, self.quantized_weight(), bias, self.repacked, self._leaf, [m.weight for m in self.mods])


def stackable(mods: list[nn.Module], layer: type, adapters: bool = False) -> bool:
    """Whether ``mods`` can run as one GEMM over their weights stacked by rows: all of type
    ``layer`` (:class:`QuantLinear` in the engine, :class:`QATLinear` in the learner), one
    scheme and input width, all with or all without a bias, no per-tensor scale, and no LoRA
    adapter unless the caller adds them to the fused output itself (``adapters``)."""
    first = mods[0]
    return (all(type(m) is layer and (adapters or getattr(m, "lora", None) is None) for m in mods)
            and all(m.scheme == first.scheme and m.in_features == first.in_features for m in mods)
            and len({m.bias is None for m in mods}) == 1 and not first.scheme.per_tensor_scale)


_GROUPS: "weakref.WeakKeyDictionary[nn.Module, dict[str, QATGroup]]" = weakref.WeakKeyDictionary()


def qat_group(owner: nn.Module, names: tuple[str, ...]) -> QATGroup | None:
    """The :class:`QATGroup` of ``owner``'s child linears ``names`` (kept per owner, outside
    the module so that copies and checkpoints never see it), or None when they are not
    fusable QAT linears."""
    mods = [getattr(owner, n) for n in names]
    groups = _GROUPS.setdefault(owner, {})
    key = ",".join(names)
    g = groups.get(key)
    if g is not None and all(a is b for a, b in zip(g.mods, mods)):
        return g
    if not stackable(mods, QATLinear):
        return None
    groups[key] = g = QATGroup(mods)
    return g


def _selected(name: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in include) and not any(
        fnmatch.fnmatchcase(name, p) for p in exclude
    )


def quantize_model(
    model: nn.Module,
    scheme: QuantScheme | str,
    layer: type[QATLinear] | type[QuantLinear] = QATLinear,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Swap the selected ``nn.Linear`` modules and MoE experts of ``model`` in place; returns
    their names (the linears', then the experts').

    ``layer=QATLinear`` (the learner's: master weights, the engine's GEMM in the forward,
    straight-through backward) or ``QuantLinear`` (the engine's: packed weights only).
    ``include``/``exclude`` are ``fnmatch`` patterns over module names; the default
    ``("layers.*",)`` takes every linear of the decoder layers and leaves embeddings,
    norms and the LM head alone. An MoE block's experts (:class:`~quarl.model.moe.Experts`,
    module name ``layers.L.mlp.experts``) are selected by the same patterns and become
    :class:`~quarl.quant.experts.QATExperts` / :class:`~quarl.quant.experts.QuantExperts`
    (every expert quantized on its own); its router (``mlp.gate``) is no linear and stays
    in the model's dtype. A scheme with a per-tensor scale (nvfp4) cannot quantize stacked
    experts: a ValueError names them and the fix (exclude ``layers.*.mlp.experts``).
    """
    scheme = get_scheme(scheme)
    if layer not in (QATLinear, QuantLinear):
        raise ValueError(f"layer must be QATLinear or QuantLinear, got {layer!r}")
    targets = selected_linears(model, include, exclude)
    experts = selected_experts(model, include, exclude)
    for name in experts:  # (refused before anything is swapped)
        check_expert_scheme(scheme, name)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.from_linear(model.get_submodule(name), scheme))
    experts_layer = QATExperts if layer is QATLinear else QuantExperts
    for name in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, experts_layer.from_experts(model.get_submodule(name), scheme, name))
    return targets + experts


def selected_linears(model: nn.Module, include: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the plain ``nn.Linear`` modules of ``model`` that :func:`quantize_model` swaps:
    matched by an ``include`` pattern (default ``("layers.*",)``) and by no ``exclude`` one."""
    include = tuple(DEFAULT_INCLUDE if include is None else include)
    exclude = tuple(exclude)
    return [name for name, mod in model.named_modules() if type(mod) is nn.Linear and _selected(name, include, exclude)]


def selected_experts(model: nn.Module, include: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the MoE blocks' plain :class:`~quarl.model.moe.Experts` (``layers.L.mlp.experts``)
    that :func:`quantize_model` swaps, selected as :func:`selected_linears` selects linears."""
    include = tuple(DEFAULT_INCLUDE if include is None else include)
    exclude = tuple(exclude)
    return [name for name, mod in model.named_modules() if type(mod) is Experts and _selected(name, include, exclude)]


def _qat_experts(model: nn.Module) -> list[QATExperts]:
    return [m for m in model.modules() if isinstance(m, QATExperts)]


def _qat_holders(model: nn.Module) -> Iterator[QATLinear | QATGroup]:
    """The model's :class:`QATLinear` and their :class:`QATGroup`."""
    for mod in model.modules():
        if isinstance(mod, QATLinear):
            yield mod
        yield from _GROUPS.get(mod, {}).values()


def drop_dequantized(model: nn.Module) -> None:
    """Free the dequantized weights the model's :class:`QATLinear` keep during an update (a
    LoRA learner's frozen bases: :func:`quarl.learner.memory.drop_dense_bases`)."""
    for holder in _qat_holders(model):
        holder.drop_dequantized()
    for experts in _qat_experts(model):
        experts.drop_dequantized()


def set_per_use_dequant(model: nn.Module, on: bool = True) -> None:
    """Whether ``model``'s aligned linears dequantize their weight at each use instead of
    keeping one dense copy per weight version through an update (the default: the fastest,
    but a bf16 copy of every quantized weight lives through the learner phase, 12 GB on a
    7B model). On: a linear's dense weight lives only while its GEMM runs (with activation
    checkpointing, one layer's at a time); the forward and the backward each dequantize
    again and the layers run outside the compiled regions. The values are the same."""
    for holder in _qat_holders(model):
        holder.drop_dequantized()
        holder._leaf.keep = not on
    for experts in _qat_experts(model):  # (their straight-through gradient needs no leaf: only the copy's lifetime)
        experts.keep_dequantized = not on


def set_straight_through(model: nn.Module) -> None:
    """``model``'s aligned linears dequantize their weight at each use and, in the learner's
    compiled regions, take it as ``W_deq + (W - W)`` (:func:`~quarl.quant.traced._straight_through`): the same
    values and gradients as the default path, without the dequantized leaf whose gradient a
    hook hands to the masters after the backward. For a sharded learner
    (:mod:`quarl.learner.sharded`), whose gathered weights must have their gradients by the
    time the backward leaves their layer. Outside the regions the linears run the autograd
    function (per use, as :func:`set_per_use_dequant`)."""
    for holder in _qat_holders(model):
        holder.drop_dequantized()
        holder._leaf.keep = False
        holder._leaf.straight_through = True
    for experts in _qat_experts(model):
        experts.keep_dequantized = False


@contextlib.contextmanager
def deferred_master_grads(model: nn.Module) -> Iterator[None]:
    """Within this block the dequantized leaves of ``model``'s aligned linears accumulate their
    gradient over several backward passes (autograd adds into them in place) and hand it to the
    master weights once, at exit, instead of after every backward: a learner's micro-batches
    then pay no Python hook per linear. The master weights' gradients are the same sums."""
    with deferring():
        try:
            yield
        finally:
            for holder in _qat_holders(model):
                holder._leaf.flush()


def invalidate_quantized(model: nn.Module) -> None:
    """Forget every :class:`QATLinear`'s (and :class:`~quarl.quant.experts.QATExperts`') cached
    quantized weight (after writes its version counter may not show: loads into shards, ``.data``)."""
    for m in model.modules():
        if isinstance(m, (QATLinear, QATExperts)):
            m.invalidate()


def requantize_stale(mods: list[QATLinear | QATExperts]) -> None:
    """Quantize the master weight of every module in ``mods`` that changed since its last
    quantization (after an optimizer step: all of them) with a few stacked quantizer calls
    (:func:`~quarl.quant.qweight.quantize_weights`) instead of one chain of small kernels per
    module. The results are the ones each module would make itself.
    :class:`~quarl.quant.experts.QATExperts` in ``mods`` (two stacked weights: one call each
    already) quantize themselves; other modules are skipped."""
    stale: dict[QuantScheme, list[QATLinear]] = {}
    for m in mods:
        if isinstance(m, QATExperts):
            m.quantized_weights()
            continue
        if not isinstance(m, QATLinear):
            continue
        if m._qw is None or m._qw_key != m._key():
            stale.setdefault(m.scheme, []).append(m)
    for scheme, ms in stale.items():
        for m, qw in zip(ms, quantize_weights([m.weight.detach() for m in ms], scheme)):
            m._qw, m._qw_key = qw, m._key()
