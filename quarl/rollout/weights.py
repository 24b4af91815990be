"""Quantizing the engine's model and loading published weights in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quarl.model.transformer import Transformer

def quantize_for_engine(model: Transformer, scheme: Any, include=None, exclude=()) -> Any:
    """Swap the selected decoder linears of ``model`` for ``QuantLinear``; returns the scheme.

    ``scheme`` is a ``QuantScheme``, a name, or ``None`` (= ``bf16``, which leaves the
    model untouched).
    """
    from quarl.quant import QuantLinear, get_scheme, quantize_model

    scheme = get_scheme("bf16" if scheme is None else scheme)
    if scheme.quantizes_weights or scheme.quantizes_activations:
        quantize_model(model, scheme, QuantLinear, include=include, exclude=exclude)
    return scheme


def _quantized_loader(module: nn.Module) -> Any:
    return getattr(module, "load_quantized", None)


@torch.no_grad()
def load_weights_in_place(model: Transformer, published: dict[str, Any]) -> None:
    """Copy ``published`` into ``model`` without reallocating any parameter or buffer.

    Tensor values go into the parameter of that name (``model.`` prefix optional); a
    tensor for a quantized linear's weight is quantized with the module's scheme
    first. Other values are handed to ``module.load_quantized`` of the named linear.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, value in published.items():
        key = name.removeprefix("model.")
        if key == "lm_head.weight" and model.lm_head is None:
            key = "embed_tokens.weight"
        if isinstance(value, torch.Tensor) and key in params:
            target = params[key]
            if tuple(target.shape) != tuple(value.shape):
                raise ValueError(f"{name}: published shape {tuple(value.shape)} vs engine {tuple(target.shape)}")
            target.copy_(value)
            continue
        module = modules.get(key.removesuffix(".weight"))
        loader = _quantized_loader(module) if module is not None else None
        if loader is None:
            raise KeyError(f"{name}: no parameter or quantized linear of that name in the engine's model")
        if isinstance(value, torch.Tensor):
            from quarl.quant import quantize_weight

            value = quantize_weight(value.to(module_device(module)), module.scheme)
        loader(value)


def module_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")
