"""Optimizers: AdamW, or Muon for 2-D hidden weights with AdamW for the rest.

QaRL's runs used Muon (lr 1e-6 on 7B+ models). Muon orthogonalises the update of a
matrix, so it applies to the decoder's linear weights only; embeddings, the LM head,
norms and biases stay on AdamW. Both live in one :class:`CombinedOptimizer` so the
trainer sees a single ``step()``/``zero_grad()``/``state_dict()``.
"""

from __future__ import annotations

import torch
from torch import nn


class CombinedOptimizer(torch.optim.Optimizer):
    """Steps several optimizers as one (for checkpointing and LR scheduling)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        groups = [g for o in optimizers for g in o.param_groups]
        # torch.optim.Optimizer.__init__ would rebuild groups; set the attributes directly.
        self.param_groups = groups
        self.defaults = {}
        self.state = {}

    def step(self, closure=None):  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):  # type: ignore[override]
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state) -> None:  # type: ignore[override]
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2 and name.startswith("layers.")


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    muon_lr: float | None = None,
) -> torch.optim.Optimizer:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in params], lr=lr, weight_decay=weight_decay, betas=betas)
    if name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ValueError("optim.name=muon needs torch >= 2.9 (torch.optim.Muon); use optim.name=adamw")
        hidden = [p for n, p in params if is_hidden_matrix(n, p)]
        rest = [p for n, p in params if not is_hidden_matrix(n, p)]
        opts: list[torch.optim.Optimizer] = [
            torch.optim.Muon(hidden, lr=muon_lr or lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        ]
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas))
        return CombinedOptimizer(opts)
    raise ValueError(f"unknown optimizer {name!r}; use adamw or muon")


def warmup_constant(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )
