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
    model: nn.Module | list[tuple[str, torch.Tensor]],
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    muon_lr: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW, or Muon + AdamW, over a module's parameters or ``(name, tensor)`` pairs."""
    named = model.named_parameters() if isinstance(model, nn.Module) else model
    params = [(n, p) for n, p in named if p.requires_grad]
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


class MasterWeights:
    """FP32 master copies of a BF16/FP16 model's parameters.

    The model keeps computing in its own dtype (the same as the rollout engine, so the
    aligned forward stays aligned); gradients are copied into the FP32 masters, the
    optimizer steps there, and the rounded result is written back into the model. An
    update far below one BF16 ulp (lr 1e-6 on weights of size 1e-2) therefore
    accumulates instead of vanishing.
    """

    def __init__(self, model: nn.Module) -> None:
        self.pairs = [(n, p, p.detach().float().clone().requires_grad_(True))
                      for n, p in model.named_parameters() if p.requires_grad]

    def named_masters(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, m) for n, _, m in self.pairs]

    def masters(self) -> list[torch.Tensor]:
        return [m for _, _, m in self.pairs]

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        for _, p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for _, p, m in self.pairs:
            p.copy_(m)  # bumps the version: quantized forwards re-quantize

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, _, m in self.pairs}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for n, _, m in self.pairs:
            m.copy_(sd[n])
        self.masters_to_model()


def warmup_constant(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )
