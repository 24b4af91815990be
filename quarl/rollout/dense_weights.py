"""The engine's dense copies of weight-only quantized weights (``EngineConfig.dense_weights``):
whether to keep them, and which GEMMs have one."""

from __future__ import annotations

import torch

DENSE_AUTO_FRACTION = 0.10  # dense_weights="auto": keep the copies when they take at most this share of the GPU


def use_dense_weights(setting: str, need_bytes: int, total_bytes: int) -> bool:
    """Whether the engine keeps dense copies of its weight-only quantized weights: ``"on"``,
    ``"off"``, or ``"auto"`` (on a GPU, when they take at most :data:`DENSE_AUTO_FRACTION`
    of its memory: every model a full fine-tune fits on one GPU, not a large frozen base)."""
    if setting == "auto":
        return 0 < need_bytes <= DENSE_AUTO_FRACTION * total_bytes
    return setting == "on"


def weight_only_caches(model: torch.nn.Module, experts: bool = True) -> list:
    """``(RepackCache, QuantizedWeight)`` of each GEMM of ``model`` over a weight-only quantized
    weight, as the engine runs them (a fused q/k/v or gate/up group once, an MoE block's
    projection of all its experts once; ``experts=False``: not those)."""
    from quarl.quant.experts import PackedExperts
    from quarl.quant.linear import QuantLinear
    from quarl.quant.qweight import QuantizedWeight

    out = []
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and not hasattr(mod, "_fused_owner"):
            out.append((mod.repacked, mod.qweight))
        if experts and isinstance(mod, PackedExperts):  # an MoE block's projection of all its experts
            out.append((mod.repacked, mod.packed))
        for name in ("_fused_qkv", "_fused_gate_up"):
            fused = mod.__dict__.get(name)
            if fused is not None and isinstance(fused.weight, QuantizedWeight):
                out.append((fused.repacked, fused.weight))
    return [(c, qw) for c, qw in out if qw.scheme.quantizes_weights and qw.scheme.act_format == "none"]


def dense_weight_plan(setting: str, model: torch.nn.Module, itemsize: int, total_bytes: int,
                      exact: bool = False) -> list:
    """The caches (:func:`weight_only_caches`) to give a dense copy: ``"on"`` every one, ``"off"``
    none; ``"auto"`` every one where all the copies take at most :data:`DENSE_AUTO_FRACTION` of
    the GPU, else those outside MoE experts where they do (an MoE model's attention: a few percent
    of its weights, read at every step whatever the routing), else none. ``exact`` (exact mode,
    whose MoE experts always run the packed grouped kernel): never the experts'. In exact mode a
    dense copy runs the invariant dense GEMM, the same bits as the packed one on the same values
    (:mod:`quarl.quant.kernels.invariant`)."""
    every = weight_only_caches(model, experts=not exact)
    if setting != "auto":
        return every if setting == "on" else []
    for chosen in (every, weight_only_caches(model, experts=False)):
        if use_dense_weights("auto", dense_bytes(chosen, itemsize), total_bytes):
            return chosen
    return []


def dense_bytes(caches: list, itemsize: int) -> int:
    """Bytes the dense copies of ``caches`` take."""
    return sum(qw.shape[0] * qw.shape[1] for _, qw in caches) * itemsize
