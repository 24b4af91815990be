"""Quantization metrics the trainer logs each step (names in docs/design.md, "Metrics").

* ``quant/update_visible_frac``: share of quantized weight codes changed by a publish.
* ``quant/rel_update`` (QuRL eq. 13): ``||theta_{t+1} - theta_t||_F^2 / ||theta_t||_F^2``.
* ``quant/rel_quant_err`` (QuRL eq. 14): ``||Q(theta) - theta||_F^2 / ||theta||_F^2``.

Each takes one tensor/QuantizedWeight or a dict of them by name (summed over the model:
numerators and denominators are added before dividing).
"""

from __future__ import annotations

from typing import Mapping, Union

import torch

from quarl.quant.qweight import QuantizedWeight

TensorOrDict = Union[torch.Tensor, Mapping[str, torch.Tensor]]
QWOrDict = Union[QuantizedWeight, Mapping[str, QuantizedWeight]]


def _pairs(a, b) -> list[tuple]:
    if isinstance(a, Mapping):
        missing = set(a) ^ set(b)
        if missing:
            raise KeyError(f"keys differ: {sorted(missing)[:5]}")
        return [(a[k], b[k]) for k in a]
    return [(a, b)]


@torch.no_grad()
def update_visible_frac(old_qw: QWOrDict, new_qw: QWOrDict) -> float:
    """Fraction of weights whose quantized code differs between two publishes."""
    changed, total = 0, 0  # ``changed`` a device tensor until the end: one host sync, not one per weight
    for old, new in _pairs(old_qw, new_qw):
        if not isinstance(old, QuantizedWeight):
            continue
        changed = changed + (old.codes() != new.codes()).sum()
        total += old.shape[0] * old.shape[1]
    return int(changed) / max(total, 1)


def _sum_sq(ts: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i ||t_i||^2`` as a float64 device scalar: each norm accumulated in float32 by one
    batched call (a few launches for a whole model, not several per weight)."""
    norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
    return torch.stack([n.to(norms[0].device) for n in norms]).double().pow(2).sum()


@torch.no_grad()
def rel_update(new_w: TensorOrDict, old_w: TensorOrDict) -> float:
    """QuRL eq. 13: ``sum ||new - old||^2 / sum ||old||^2`` (norms accumulated in float32)."""
    pairs = _pairs(new_w, old_w)
    if not pairs:
        return 0.0
    new, old = [p[0].float() for p in pairs], [p[1].float() for p in pairs]
    num, den = float(_sum_sq(torch._foreach_sub(new, old))), float(_sum_sq(old))  # one host sync
    return num / den if den > 0 else 0.0


@torch.no_grad()
def rel_quant_err(w: TensorOrDict, qw: QWOrDict) -> float:
    """QuRL eq. 14: ``sum ||Q(w) - w||^2 / sum ||w||^2`` with ``Q(w) = qw.dequantize()`` (in
    float32, where every format's dequantization is exact up to one rounding; norms
    accumulated in float32)."""
    pairs = _pairs(w, qw)
    if not pairs:
        return 0.0
    ws = [p[0].float() for p in pairs]
    deq = [q.dequantize(torch.float32).to(wt.device) for wt, (_, q) in zip(ws, pairs)]
    num, den = float(_sum_sq(torch._foreach_sub(deq, ws))), float(_sum_sq(ws))  # one host sync
    return num / den if den > 0 else 0.0
