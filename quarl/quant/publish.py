"""Weights from the learner to the engine: :func:`publish_model` (what the learner's linears
last ran on, by parameter name) and :func:`load_published` (into the engine's model in place)."""

from __future__ import annotations

import torch
from torch import nn

from quarl.quant.experts import PackedExperts, QATExperts, QuantExperts
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.linear import QATLinear, QuantLinear, requantize_stale
from quarl.quant.qweight import QuantizedWeight, quantize_weight


def publish_model(model: nn.Module) -> dict[str, QuantizedWeight | torch.Tensor]:
    """Everything the engine needs, by parameter name: ``"<linear>.weight"`` maps to the
    ``QuantizedWeight`` of each quantized linear (the one its last forward used),
    ``"<experts>.gate_up_proj"`` / ``"<experts>.down_proj"`` (the parameters' names) to the
    ``[E * N, K]`` ``QuantizedWeight`` of each quantized MoE experts module, every other
    parameter (norms, embeddings, LM head, router, biases) to its detached tensor."""
    out: dict[str, QuantizedWeight | torch.Tensor] = {}
    quantized = {}
    requantize_stale([m for m in model.modules() if isinstance(m, QATLinear)])
    for name, mod in model.named_modules():
        if isinstance(mod, QATLinear):
            quantized[f"{name}.weight" if name else "weight"] = mod.publish()
        elif isinstance(mod, QuantLinear):
            quantized[f"{name}.weight" if name else "weight"] = mod.qweight
        elif isinstance(mod, (QATExperts, QuantExperts)):
            weights = mod.publish() if isinstance(mod, QATExperts) else mod.quantized_weights()
            quantized.update({f"{name}.{proj}" if name else proj: qw for proj, qw in weights.items()})
    out.update(quantized)
    for name, p in model.named_parameters():
        if name not in out:
            out[name] = p.detach()
    return out


@torch.no_grad()
def load_published(model: nn.Module, published: dict[str, QuantizedWeight | torch.Tensor]) -> None:
    """Engine side of :func:`publish_model`: copy ``published`` into ``model`` in place, never
    reallocating a parameter or buffer (captured CUDA graphs stay valid).

    Keys are parameter names (HF's ``model.`` prefix optional; ``lm_head.weight`` of a tied
    model goes to ``embed_tokens.weight``). A tensor goes into the parameter of that name;
    a :class:`QuantizedWeight`, or a tensor for a :class:`QuantLinear`'s weight (quantized
    with the module's scheme first), goes to that module's storage, whose kernel layouts
    are then rebuilt (as ``load_quantized`` does). Likewise for a projection of
    :class:`~quarl.quant.experts.QuantExperts` (key ``<experts>.gate_up_proj``: the ``[E * N, K]``
    ``QuantizedWeight``, or the ``[E, N, K]`` tensor, quantized per expert first).

    Everything is checked before anything is written; the copies then run as one batched
    call and each layout cache (a fused group's: once for all its members) is rebuilt once.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    tied = getattr(model, "lm_head", "absent") is None
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    stale: dict[int, tuple[RepackCache, QuantizedWeight]] = {}
    for name, value in published.items():
        key = name.removeprefix("model.")
        if key == "lm_head.weight" and tied:
            key = "embed_tokens.weight"
        if isinstance(value, torch.Tensor) and key in params:
            target = params[key]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"{name}: published shape {tuple(value.shape)} vs model {tuple(target.shape)}")
            copies.append((target, value))
            continue
        module = modules.get(key.removesuffix(".weight"))
        if isinstance(module, PackedExperts):
            target = module.packed
            copies += target.copy_pairs(module.as_packed(value, name))
            stale[id(module.repacked)] = (module.repacked, target)
            continue
        if not isinstance(module, QuantLinear):
            what = "no parameter or linear" if module is None else f"a {type(module).__name__}, not a QuantLinear"
            raise KeyError(f"{name}: {what} of that name in the model")
        if isinstance(value, torch.Tensor):
            value = quantize_weight(value.to(next(module.buffers()).device), module.scheme)
        copies += module.qweight.copy_pairs(value)
        target, cache, _ = module.layouts()
        stale[id(cache)] = (cache, target)
    if copies:
        dst, src = zip(*copies)
        torch._foreach_copy_(list(dst), list(src))
    for cache, target in stale.values():
        cache.refresh(target)
