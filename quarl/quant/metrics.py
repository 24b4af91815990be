"""Quantization metrics the trainer logs each step (names in DESIGN.md, "Metrics").

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


@torch.no_grad()
def rel_update(new_w: TensorOrDict, old_w: TensorOrDict) -> float:
    """QuRL eq. 13: ``sum ||new - old||^2 / sum ||old||^2``."""
    num = den = 0.0  # device tensors until the end (one host sync)
    for new, old in _pairs(new_w, old_w):
        num = num + (new.double() - old.double()).pow(2).sum()
        den = den + old.double().pow(2).sum()
    num, den = float(num), float(den)
    return num / den if den > 0 else 0.0


@torch.no_grad()
def rel_quant_err(w: TensorOrDict, qw: QWOrDict) -> float:
    """QuRL eq. 14: ``sum ||Q(w) - w||^2 / sum ||w||^2`` with ``Q(w) = qw.dequantize()``."""
    num = den = 0.0  # device tensors until the end (one host sync)
    for wt, q in _pairs(w, qw):
        wd = wt.double()
        num = num + (q.dequantize(torch.float64).to(wd.device) - wd).pow(2).sum()
        den = den + wd.pow(2).sum()
    num, den = float(num), float(den)
    return num / den if den > 0 else 0.0
