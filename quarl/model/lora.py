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
PEFT_PREFIX = "base_model.model.model."


class LoRAAdapter(nn.Module):
    """The low-rank update of one linear: ``forward(x) = scaling * B (A x)``, in ``x``'s dtype."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
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


def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
             dtype: torch.dtype | None = None) -> list[str]:
    """Freeze every parameter of ``model`` and give each decoder linear named in ``targets``
    (the last component of its name: ``q_proj``, ``down_proj``, ...) an adapter of ``rank``
    and ``alpha``; returns the adapted linears' names. Plain ``nn.Linear`` bases become
    :class:`LoRALinear`; quantized ones (``QuantLinear``: packed, a ``qweight``) carry the adapter
    themselves. The adapters take ``dtype`` (default: the model's embedding dtype)."""
    targets = tuple(targets)
    unknown = sorted(set(targets) - set(DEFAULT_TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {', '.join(unknown)}; targets are {', '.join(DEFAULT_TARGETS)}")
    model.requires_grad_(False)
    ref = next(model.parameters())
    dtype = dtype or ref.dtype
    names = []
    for name, mod in list(model.named_modules()):
        if not _is_target(name, targets):
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
    if not names:
        raise ValueError(f"no decoder linear named {', '.join(targets)} to put a LoRA adapter on")
    return names


def _is_packed(mod: nn.Module) -> bool:
    """A ``QuantLinear`` (quarl.quant imports this module, so it is told by its packed weight)."""
    return hasattr(mod, "qweight") and hasattr(mod, "load_quantized")


def lora_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, LoRAAdapter]]:
    """``(linear name, linear, adapter)`` of every adapted linear."""
    for name, mod in model.named_modules():
        ad = getattr(mod, "lora", None)
        if isinstance(ad, LoRAAdapter):
            yield name, mod, ad


def has_lora(model: nn.Module) -> bool:
    return next(lora_modules(model), None) is not None


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (``layers.0.self_attn.q_proj.lora.A`` ...)."""
    return {f"{name}.lora.{p}": getattr(ad, p).detach() for name, _, ad in lora_modules(model) for p in ("A", "B")}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base inside this block (the reference policy of a LoRA run)."""
    ads = [ad for _, _, ad in lora_modules(model)]
    states = [ad.enabled for ad in ads]
    for ad in ads:
        ad.enabled = False
    try:
        yield
    finally:
        for ad, s in zip(ads, states):
            ad.enabled = s


def peft_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters in PEFT's saved layout (``adapter_model.safetensors``)."""
    out = {}
    for name, _, ad in lora_modules(model):
        for p, peft in (("A", "lora_A"), ("B", "lora_B")):
            t = getattr(ad, p).detach()
            out[f"{PEFT_PREFIX}{name}.{peft}.weight"] = (t if dtype is None else t.to(dtype)).contiguous().cpu()
    return out


def peft_config(model: nn.Module, base_model_path: str | None) -> dict:
    """``adapter_config.json`` for the adapters of ``model`` (one rank and alpha for all)."""
    ads = list(lora_modules(model))
    if not ads:
        raise ValueError("the model has no LoRA adapters to export")
    ranks = {ad.rank for _, _, ad in ads}
    alphas = {ad.alpha for _, _, ad in ads}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"adapters of several ranks {sorted(ranks)} / alphas {sorted(alphas)}: PEFT's "
                         "config takes one of each")
    targets = sorted({name.rpartition(".")[2] for name, _, _ in ads})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": ranks.pop(), "lora_alpha": alphas.pop(), "lora_dropout": 0.0, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }


@torch.no_grad()
def merged_weight(mod: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight ``[N, K]`` of an adapted linear with its adapter merged in:
    ``deq(W) + scaling * B A`` (the base dequantized when it is low-bit), in ``dtype``."""
    base = mod.qweight.dequantize().to(torch.float32) if _is_packed(mod) else mod.weight.float()
    ad = getattr(mod, "lora", None)
    if ad is not None:
        base = base + ad.scaling * (ad.B.float() @ ad.A.float())
    return base.to(dtype)
