"""Quantizing the engine's model and loading published weights in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quarl.model.transformer import Transformer

_FULL_PRECISION = (None, "bf16", "fp16", "fp32", "none")


def quantize_for_engine(model: Transformer, scheme: Any) -> Any:
    """Swap the decoder linears of ``model`` for ``quarl.quant.QuantLinear``; returns the scheme.

    ``scheme`` is a ``QuantScheme``, a name for ``quarl.quant.get_scheme`` or ``None``.
    Full-precision schemes leave the model untouched (returns ``None``).
    """
    if scheme in _FULL_PRECISION or getattr(scheme, "name", None) in _FULL_PRECISION[1:]:
        return None
    try:
        from quarl.quant import QuantLinear, get_scheme, quantize_model
    except ImportError as e:  # quarl.quant not built yet
        raise NotImplementedError(f"scheme {scheme!r} needs quarl.quant.quantize_model / get_scheme: {e}") from e
    if isinstance(scheme, str):
        scheme = get_scheme(scheme)
    if not scheme.quantizes_weights and not scheme.quantizes_activations:
        return None
    quantize_model(model, scheme, QuantLinear)
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
