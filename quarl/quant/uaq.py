"""UAQ: update-aware quantization by invariant scaling (QuRL section 4.3, eqs. 11-12).

For every decoder layer, ``W x = (W / s)(s x)``: the RMSNorm weight that feeds q/k/v is
multiplied by ``s`` and the input columns of q_proj, k_proj and v_proj divided by ``s``;
likewise ``post_attention_layernorm`` and gate_proj/up_proj, or in an MoE layer the router
(whose top-k would otherwise see scaled logits) and the experts' stacked gate/up
projection. The model's function is
unchanged (exactly, up to rounding), while with ``s > 1`` the weights' quantization
error shrinks by ``s`` and, since ``grad_W = grad_y x^T`` sees activations ``s`` times
larger, each update grows by ``s`` relative to the grid: ``s^2`` in their ratio.
QuRL uses ``s = 1.5``. ``remove_uaq`` (``apply_uaq(model, 1 / s)``) undoes it for export.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.moe import SparseMoeBlock
from quarl.quant.experts import QuantExperts
from quarl.quant.linear import QuantLinear

ATTN_INPUTS = ("q_proj", "k_proj", "v_proj")
MLP_INPUTS = ("gate_proj", "up_proj")


@torch.no_grad()
def _scale_inputs(module: nn.Module, inv_scale: float, weights: tuple[str, ...] = ("weight",)) -> None:
    if isinstance(module, (QuantLinear, QuantExperts)):
        raise TypeError("apply UAQ to master weights before building QuantLinear / QuantExperts modules")
    for name in weights:
        getattr(module, name).mul_(inv_scale)
    if hasattr(module, "invalidate"):
        module.invalidate()


@torch.no_grad()
def apply_uaq(model: nn.Module, scale: float = 1.5) -> nn.Module:
    """Apply invariant scaling ``s = scale`` to every decoder layer of ``model`` in place."""
    if scale <= 0:
        raise ValueError(f"UAQ scale must be positive, got {scale}")
    for layer in model.layers:
        layer.input_layernorm.weight.mul_(scale)
        for name in ATTN_INPUTS:
            _scale_inputs(getattr(layer.self_attn, name), 1.0 / scale)
        layer.post_attention_layernorm.weight.mul_(scale)
        if isinstance(layer.mlp, SparseMoeBlock):
            _scale_inputs(layer.mlp.gate, 1.0 / scale)
            _scale_inputs(layer.mlp.experts, 1.0 / scale, ("gate_up_proj",))
            continue
        for name in MLP_INPUTS:
            _scale_inputs(getattr(layer.mlp, name), 1.0 / scale)
    return model


def remove_uaq(model: nn.Module, scale: float = 1.5) -> nn.Module:
    """Undo :func:`apply_uaq` with the same ``scale`` (for BF16 export)."""
    return apply_uaq(model, 1.0 / scale)
