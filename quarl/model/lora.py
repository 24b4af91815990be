"""LoRA adapters on a frozen base: ``y = base(x) + (alpha / r) * B (A x)``.

The base of each target linear stays what it is in the rollout scheme (a
:class:`~quarl.quant.linear.QuantLinear` over packed low-bit codes, or a plain bf16
linear) and never trains; only ``A [r, K]`` and ``B [N, r]`` do. The adapter lives on
the base module as ``<linear>.lora`` (:class:`LoRAAdapter`), so the base's own forward
adds it (``QuantLinear.forward``, :class:`LoRALinear`), wherever the module is called:
the learner's forward and the rollout engine run the same base GEMM plus the same
adapter math, which makes a LoRA run aligned by construction. The engine's fused q/k/v
and gate/up GEMMs are skipped for linears with an adapter (``stackable``), so no path
bypasses it.

``A`` starts as PEFT's (Kaiming-uniform with ``a = sqrt(5)``) and ``B`` at zero: step 0
is the base model. Parameter names are the base's plus ``.lora.A`` / ``.lora.B``;
:func:`peft_state_dict` renames them to PEFT's saved layout
(``base_model.model.model.<linear>.lora_A.weight``), which PEFT loads with
``PeftModel.from_pretrained`` onto the transformers model of the same checkpoint.

Targets are names of decoder linears (:data:`DEFAULT_TARGETS`) plus ``experts``
(:data:`EXPERT_TARGET`). On a Qwen3-MoE model the MLP names (``gate_proj`` / ``up_proj`` /
``down_proj``) adapt nothing, not even the dense MLPs of the layers that keep one
(``mlp_only_layers``, or those ``decoder_sparse_step`` skips): PEFT (0.21 with transformers 5,
``convert_peft_config_for_transformers``) reads those names in a Qwen3-MoE's
``target_modules`` as the stacked experts' parameters (its conversion of transformers-4
adapters), so no PEFT adapter could hold them, and one rule for all layers is simpler. The
default targets of an MoE model are thus its attention projections; MLP names alone are
refused there. The experts are adapted only when
``experts`` is named (:class:`ExpertsLoRA`): per expert and stacked projection
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) an ``A_e [r, K]`` and a ``B_e [N, r]``
held stacked as ``A [E, r, K]`` / ``B [E, N, r]``, run by the experts' forward as two
grouped GEMMs over the rows it has sorted by expert and added to that projection's output.
Their names are ``<experts>.lora.gate_up_proj.A`` ... and their PEFT form is
``target_parameters`` (:func:`peft_state_dict`).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from quarl.quant.ops import LoRATerm

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # dense MLP linears: none adapted in an MoE model
EXPERT_TARGET = "experts"  # opt-in: grouped adapters on every MoE block's experts
ALL_TARGETS = DEFAULT_TARGETS + (EXPERT_TARGET,)
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # the stacked expert parameters an ExpertsLoRA adapts
PEFT_PREFIX = "base_model.model.model."
# PEFT nests one ParamWrapper per targeted parameter of a module, in the module's parameter order
# (transformers' Qwen3MoeExperts: gate_up_proj, then down_proj): the first is the inner one, under base_layer
_PEFT_EXPERT_KEYS = {"gate_up_proj": ".base_layer", "down_proj": ""}


def _rank_alpha_scaling(rank: int, alpha: float) -> tuple[int, float, float]:
    """An adapter's ``(rank, alpha, scaling = alpha / rank)``, the rank checked."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    return rank, float(alpha), float(alpha) / rank


class LoRAAdapter(nn.Module):
    """The low-rank update of one linear: ``forward(x) = scaling * B (A x)``, in ``x``'s dtype."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.rank, self.alpha, self.scaling = _rank_alpha_scaling(rank, alpha)
        self.A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B) * self.scaling

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """:func:`add_adapter` of this adapter: what a base linear's forward returns."""
        return add_adapter(y, x, self.A, self.B, self.scaling)

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """:meth:`add_to` in place, into ``y`` (rows; a column block of a fused GEMM's output)."""
        y.addmm_(F.linear(x, self.A), self.B.t(), alpha=self.scaling)

    def term(self, x: torch.Tensor) -> LoRATerm:
        """This adapter on ``x`` as a GEMM's LoRA term (:func:`quarl.quant.ops.quant_linear` adds it)."""
        from quarl.quant.ops import LoRATerm  # (quarl.quant imports this module)

        return LoRATerm(F.linear(x.reshape(-1, x.shape[-1]), self.A), self.B, self.scaling, self.rank)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, in={self.A.shape[1]}, out={self.B.shape[0]}"


def add_adapter(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``y + scaling * b (a x)``: the shrink, then :func:`add_expand`; the learner's compiled
    regions call it too."""
    return add_expand(y, F.linear(x.reshape(-1, x.shape[-1]), a), b, scaling)


def add_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``y + scaling * xa b^T`` as one ``addmm`` over rows (``xa``: the shrink's rows; the scaled
    product and the sum rounded once, no separate scale and add kernels)."""
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa, b.t(), alpha=scaling).view(y.shape)


def apply_adapter(mod: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (the base's output on ``x``) plus ``mod``'s adapter, if it has an enabled one."""
    ad = getattr(mod, "lora", None)
    if ad is None or not ad.enabled:
        return y
    return ad.add_to(y, x)


class LoRALinear(nn.Linear):
    """A plain (bf16 / fp32) frozen linear with an adapter: the base of a LoRA run without a
    low-bit scheme. It shares the original module's parameters."""

    lora: LoRAAdapter

    @classmethod
    def wrap(cls, linear: nn.Linear) -> "LoRALinear":
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = linear.in_features, linear.out_features
        mod.weight, mod.bias = linear.weight, linear.bias
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_adapter(self, x, F.linear(x, self.weight, self.bias))


def _is_target(name: str, targets: tuple[str, ...]) -> bool:
    return name.startswith("layers.") and name.rpartition(".")[2] in targets


class GroupedLoRA(nn.Module):
    """The adapters of one stacked expert projection ``W [E, N, K]``: ``A [E, r, K]`` and
    ``B [E, N, r]``, expert ``e``'s update ``scaling * B[e] A[e]``. ``A`` starts as
    :class:`LoRAAdapter`'s (per expert: uniform in ``+-1 / sqrt(K)``, PEFT's Kaiming bound),
    ``B`` at zero."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, rank: int, alpha: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.rank, self.alpha, self.scaling = _rank_alpha_scaling(rank, alpha)
        self.A = nn.Parameter(torch.empty(num_experts, rank, in_features, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(num_experts, out_features, rank, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) of one expert's [r, K]
        nn.init.uniform_(self.A, -bound, bound)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``y + scaling * B[e] (A[e] x)`` for rows ``x [M, K]`` sorted by expert (``offsets``: the
        end of each expert's rows, as :func:`quarl.model.moe.grouped_linear` takes them)."""
        xa = _grouped(x.to(self.A.dtype), self.A, offsets)
        return y + (_grouped(xa, self.B, offsets) * self.scaling).to(y.dtype)

    @torch.no_grad()
    def delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The update of the stacked weight, ``scaling * B A`` ``[E, N, K]``, in ``dtype``."""
        return (torch.bmm(self.B.float(), self.A.float()) * self.scaling).to(dtype)

    def extra_repr(self) -> str:
        e, r, k = self.A.shape
        return f"experts={e}, rank={r}, alpha={self.alpha:g}, in={k}, out={self.B.shape[1]}"


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`quarl.model.moe.grouped_linear`, but the padded batched GEMM where the output rows
    (``weight.shape[1]``: a small rank) are not 16-byte multiples, which the grouped GEMM's
    backward needs for its gradients (``grouped_linear`` checks the input's rows only)."""
    from quarl.model.moe import grouped_linear, padded_grouped_linear

    if (weight.shape[1] * weight.element_size()) % 16:
        return padded_grouped_linear(x, weight, offsets)
    return grouped_linear(x, weight, offsets)


class ExpertsLoRA(nn.Module):
    """The adapters of one MoE block's experts (module docstring): a :class:`GroupedLoRA` per
    stacked projection, ``gate_up_proj`` (``K = H``, ``N = 2I``: one adapter over the fused
    gate and up rows, as PEFT adapts transformers' parameter) and ``down_proj`` (``K = I``,
    ``N = H``). The experts' forward adds them while ``enabled``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, rank: int, alpha: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.rank, self.alpha = rank, float(alpha)
        self.gate_up_proj = GroupedLoRA(num_experts, hidden_size, 2 * intermediate_size, rank, alpha, device, dtype)
        self.down_proj = GroupedLoRA(num_experts, intermediate_size, hidden_size, rank, alpha, device, dtype)
        self.enabled = True


def _expert_dims(name: str, mod: nn.Module) -> tuple[int, int, int] | None:
    """``(E, H, I)`` of a module holding an MoE block's experts (None: not one). An experts module
    takes adapters when it has a ``lora`` attribute (None until one is attached): the promise
    that its forward adds them (:class:`quarl.model.moe.Experts`); one without is refused."""
    if not (hasattr(mod, "num_experts") and hasattr(mod, "intermediate_size")):
        return None
    if not hasattr(mod, "lora"):
        raise ValueError(f"{name}: experts of type {type(mod).__name__} do not run LoRA adapters (no `lora` "
                         f"attribute); expert adapters need experts whose forward adds them")
    hidden = getattr(mod, "hidden_size", None) or mod.gate_up_proj.shape[-1]
    return mod.num_experts, hidden, mod.intermediate_size


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
             dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of ``model`` and give each decoder linear named in ``targets``
    (the last component of its name: ``q_proj``, ``down_proj``, ...) an adapter of ``rank``
    and ``alpha``, and with ``experts`` in ``targets`` every MoE block's experts an
    :class:`ExpertsLoRA`; returns the adapted modules' names. Plain ``nn.Linear`` bases become
    :class:`LoRALinear`; quantized ones (``QuantLinear``: packed, a ``qweight``) carry the adapter
    themselves. The adapters take ``dtype`` (default: the model's embedding dtype). In an MoE
    model the MLP names adapt nothing (module docstring)."""
    targets = tuple(targets)
    unknown = sorted(set(targets) - set(ALL_TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {', '.join(unknown)}; targets are {', '.join(ALL_TARGETS)}")
    model.requires_grad_(False)
    ref = next(model.parameters())
    dtype = dtype or ref.dtype
    moe = _is_moe(model)
    names = []
    for name, mod in list(model.named_modules()):
        if not _is_target(name, targets) or (moe and name.rpartition(".")[2] in MLP_TARGETS):
            continue
        if name.rpartition(".")[2] == EXPERT_TARGET:
            dims = _expert_dims(name, mod)
            if dims is not None:
                mod.lora = ExpertsLoRA(*dims, rank, alpha, device=ref.device, dtype=dtype)
                names.append(name)
            continue
        if hasattr(mod, "quantized_weight"):  # a QATLinear
            raise ValueError(f"{name} is a QATLinear (master weights): LoRA's base stays frozen in the rollout "
                             "scheme, so it is a QuantLinear; build the LoRA model from plain linears")
        if type(mod) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            mod = LoRALinear.wrap(mod)
            setattr(model.get_submodule(parent_name), child, mod)
        elif not (isinstance(mod, LoRALinear) or _is_packed(mod)):
            continue
        mod.lora = LoRAAdapter(mod.in_features, mod.out_features, rank, alpha, device=ref.device, dtype=dtype)
        names.append(name)
    if EXPERT_TARGET in targets and not any(n.endswith("." + EXPERT_TARGET) for n in names):
        raise ValueError(f"LoRA target {EXPERT_TARGET!r} adapts the experts of MoE layers, and this model has "
                         "none (a dense model): drop it from the targets")
    if not names and moe:
        raise ValueError(f"LoRA targets {', '.join(targets)} adapt nothing in an MoE model: its MLP names adapt "
                         f"no layer (module docstring); name attention projections or {EXPERT_TARGET!r}")
    if not names:
        raise ValueError(f"no decoder linear named {', '.join(targets)} to put a LoRA adapter on")
    return names


def _is_moe(model: nn.Module) -> bool:
    from quarl.model.moe import SparseMoeBlock

    return any(isinstance(m, SparseMoeBlock) for m in model.modules())


def _is_packed(mod: nn.Module) -> bool:
    """A ``QuantLinear`` (quarl.quant imports this module, so it is told by its packed weight)."""
    return hasattr(mod, "qweight") and hasattr(mod, "load_quantized")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, LoRAAdapter]]:
    """``(linear name, linear, adapter)`` of every adapted linear."""
    for name, mod in model.named_modules():
        ad = getattr(mod, "lora", None)
        if isinstance(ad, LoRAAdapter):
            yield name, mod, ad


def expert_lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertsLoRA]]:
    """``(experts name, experts module, adapters)`` of every MoE block whose experts are adapted."""
    for name, mod in model.named_modules():
        ad = getattr(mod, "lora", None)
        if isinstance(ad, ExpertsLoRA):
            yield name, mod, ad


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None or next(expert_lora_modules(model), None) is not None


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (``layers.0.self_attn.q_proj.lora.A`` ...,
    ``layers.0.mlp.experts.lora.gate_up_proj.A`` ...)."""
    out = {f"{name}.lora.{p}": getattr(ad, p).detach() for name, _, ad in lora_modules(model) for p in ("A", "B")}
    for name, _, ad in expert_lora_modules(model):
        out.update({f"{name}.lora.{key}": t.detach() for key, t in ad.named_parameters()})
    return out


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside this block (the reference policy of a LoRA run)."""
    ads = [ad for _, _, ad in lora_modules(model)] + [ad for _, _, ad in expert_lora_modules(model)]
    states = [ad.enabled for ad in ads]
    for ad in ads:
        ad.enabled = False
    try:
        yield
    finally:
        for ad, s in zip(ads, states):
            ad.enabled = s


def peft_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters in PEFT's saved layout (``adapter_model.safetensors``).

    Expert adapters take the layout of PEFT's ``ParamWrapper`` on transformers' stacked
    parameters (``target_parameters``): per projection ``lora_A.weight [E * r, K]`` (expert
    ``e``'s rows ``e * r : (e + 1) * r``) and ``lora_B.weight [N, r * E]`` (column ``j * E + e``
    is expert ``e``'s rank ``j``), under ``<experts>.base_layer`` for ``gate_up_proj`` (PEFT's
    inner wrapper) and ``<experts>`` for ``down_proj``."""

    def put(key: str, t: torch.Tensor) -> None:
        out[key] = (t if dtype is None else t.to(dtype)).contiguous().cpu()

    out: dict[str, torch.Tensor] = {}
    for name, _, ad in lora_modules(model):
        for p, peft in (("A", "lora_A"), ("B", "lora_B")):
            put(f"{PEFT_PREFIX}{name}.{peft}.weight", getattr(ad, p).detach())
    for name, _, ad in expert_lora_modules(model):
        for proj in EXPERT_PROJECTIONS:
            grouped: GroupedLoRA = getattr(ad, proj)
            a, b = grouped.A.detach(), grouped.B.detach()
            e, r, k = a.shape
            where = f"{PEFT_PREFIX}{name}{_PEFT_EXPERT_KEYS[proj]}"
            put(f"{where}.lora_A.weight", a.reshape(e * r, k))
            put(f"{where}.lora_B.weight", b.permute(1, 2, 0).reshape(b.shape[1], r * e))
    return out


def peft_config(model: nn.Module, base_model_path: str | None) -> dict:
    """``adapter_config.json`` for the adapters of ``model`` (one rank and alpha for all)."""
    ads = list(lora_modules(model)) + list(expert_lora_modules(model))
    if not ads:
        raise ValueError("the model has no LoRA adapters to export")
    ranks = {ad.rank for _, _, ad in ads}
    alphas = {ad.alpha for _, _, ad in ads}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)} / alphas {sorted(alphas)}: PEFT's "
                         "config takes one of each")
    targets = sorted({name.rpartition(".")[2] for name, _, _ in lora_modules(model)})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": ranks.pop(), "lora_alpha": alphas.pop(), "lora_dropout": 0.0, "target_modules": targets or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    if next(expert_lora_modules(model), None) is not None:
        # PEFT's LoRA on transformers' stacked expert parameters (ParamWrapper), one A / B per expert
        config["target_parameters"] = [f"mlp.experts.{proj}" for proj in EXPERT_PROJECTIONS]
    return config


@torch.no_grad()
def merged_weight(mod: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[N, K]`` of an adapted linear with its adapter merged in:
    ``deq(W) + scaling * B A`` (the base dequantized when it is low-bit), in ``dtype``."""
    base = mod.qweight.dequantize().to(torch.float32) if _is_packed(mod) else mod.weight.float()
    ad = getattr(mod, "lora", None)
    if ad is not None:
        base = base + ad.scaling * (ad.B.float() @ ad.A.float())
    return base.to(dtype)


@torch.no_grad()
def merged_experts(mod: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The stacked expert weights (``gate_up_proj``, ``down_proj``) of an experts module with its
    :class:`ExpertsLoRA` merged in: ``W[e] + scaling * B[e] A[e]``, in ``dtype``."""
    ad = getattr(mod, "lora", None)
    out = {}
    for proj in EXPERT_PROJECTIONS:
        w = getattr(mod, proj).detach().float()
        if isinstance(ad, ExpertsLoRA):
            w = w + getattr(ad, proj).delta(torch.float32)
        out[proj] = w.to(dtype)
    return out
