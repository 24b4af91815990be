"""Optimizers: AdamW, or Muon for 2-D hidden weights with AdamW for the rest.

QaRL's runs used Muon (lr 1e-6 on 7B+ models). Muon orthogonalises the update of a
matrix, so it applies to the decoder's linear weights only; embeddings, the LM head,
norms and biases stay on AdamW. Both live in one :class:`CombinedOptimizer` so the
trainer sees a single ``step()``/``zero_grad()``/``state_dict()``.

Memory per trained parameter (:func:`training_memory_bytes`): a bf16 model stepped
through fp32 master copies (:class:`MasterWeights`) with fp32 Adam states holds 20 bytes
at the optimizer step (bf16 weight and gradient, fp32 master and its gradient, m, v).
:class:`LeanAdamW` keeps m and v in bf16 and can step bf16 weights directly with
stochastic rounding: 8 bytes (bf16 weight, gradient, m, v).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from torch.optim._muon import muon as muon_step


STEP_CHUNK = 1 << 24  # elements per slice of LeanAdamW's float32 working copies (64 MB each)


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (float32) rounded to one of its two bfloat16 neighbours at random, the upper one
    with probability (distance to the lower) / (gap between them), so that ``E[result] = x``.

    A bf16 number is the upper 16 bits of a float32: adding 16 uniform random bits to the
    lower half and dropping it carries into the upper half with exactly that probability.
    The bits are sign and magnitude, so this rounds the magnitude and keeps the sign; an
    infinity stays one."""
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic rounding takes float32 values, got {x.dtype}")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -(1 << 16)  # -(1 << 16): the int32 mask 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)


class StochasticRounding:
    """The random bits of an optimizer's stochastic rounding: one ``torch.Generator`` per
    kind of device (a process computes on one accelerator), seeded with ``seed`` when first
    used. Its state travels in the optimizer's ``state_dict``, so a resumed run draws the bits
    an uninterrupted one would, on whichever device index the resumed process has.

    Whole tensors, which every rank of a job steps alike, draw from the shared generator:
    the ranks' copies must stay equal. A rank's shards of a sharded tensor (``shard=True``)
    draw from a second generator seeded by the rank as well, so no two ranks' shards take
    the same bits."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device, shard: bool = False) -> torch.Generator:
        key = device.type + ("/shard" if shard else "")
        if key not in self.generators:
            # (a checkpoint of sharded ranks restores "/shard" generators in one process too: rank 0)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            seed = self.seed * 1_000_003 + 1 + rank if shard else self.seed
            self.generators[key] = torch.Generator(device=device).manual_seed(seed)
        return self.generators[key]

    def __call__(self, x: torch.Tensor, shard: bool = False) -> torch.Tensor:
        return stochastic_round_to_bf16(x, self.generator(x.device, shard))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: g.get_state() for key, g in self.generators.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        """Generator states by device kind ("cuda"; older checkpoints: "cuda:0"). A state is
        a CPU byte tensor whatever the generator's device; one for a kind of device this
        machine lacks (a GPU run resumed on a CPU) has nothing to continue and is left out."""
        for key, state in states.items():
            device = torch.device(key.split("/")[0])
            if device.type == "cuda" and not torch.cuda.is_available():
                continue
            self.generator(device, shard=key.endswith("/shard")).set_state(state.to("cpu"))


def _check_bf16_params(params: Iterable[torch.Tensor], what: str) -> None:
    for p in params:
        if p.dtype != torch.bfloat16:
            raise ValueError(f"{what} writes bfloat16 weights, got a {p.dtype} parameter of shape "
                             f"{tuple(p.shape)}: step 16-bit weights through fp32 masters (optim.fp32_master=true) "
                             "or train in bfloat16 (model.dtype=bfloat16)")


class _RoundingOptimizer:
    """What the stochastically rounding optimizers share: the step's walk over the parameters
    that have a gradient, and the rounding generator kept in the state dict (exact resume)."""

    rounding: StochasticRounding

    def _params_with_grads(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield p, self.state[p], group

    def state_dict(self) -> dict:  # type: ignore[override]
        sd = super().state_dict()
        sd["rounding"] = self.rounding.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        self.rounding.load_state_dict(state_dict.pop("rounding", {}))
        super().load_state_dict(state_dict)


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class LeanAdamW(_RoundingOptimizer, torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's update: decoupled weight decay, bias-corrected moments)
    with two memory options.

    * ``state_dtype=torch.bfloat16`` keeps m and v in bf16 (2 bytes each instead of 4).
      Each step computes in float32 and writes them back with stochastic rounding: rounded
      to nearest, ``v * 0.999`` (a relative change below half a bf16 ulp, 2^-9) would round
      back to ``v``, so v would never decay, and both moments would stall short of a steady
      gradient's value; stochastic rounding keeps every write unbiased.
    * ``stochastic_rounding=True`` steps bf16 weights directly (no fp32 master): the new
      weight is computed in float32 and written back with stochastic rounding
      (:func:`stochastic_round_to_bf16`), so an update far below one bf16 ulp (lr 1e-6)
      moves the weight by one ulp with the matching probability instead of vanishing.

    The random bits come from :class:`StochasticRounding` (seed ``seed``), saved in
    :meth:`state_dict`: resuming from a checkpoint continues bit for bit. With float32
    parameters and states the step is torch.optim.AdamW's, to float32 rounding. The
    parameters are stepped one at a time and in slices of :data:`STEP_CHUNK` elements, so
    the float32 working copies of 16-bit weights and states stay a few slices' size. The
    state keys (``step``, ``exp_avg``, ``exp_avg_sq``) are torch.optim.AdamW's: a checkpoint of
    either loads into the other, the moments converted to this optimizer's ``state_dtype``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, state_dtype: torch.dtype = torch.float32,
                 stochastic_rounding: bool = False, seed: int = 0) -> None:
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        if stochastic_rounding:
            _check_bf16_params((p for g in self.param_groups for p in g["params"]), "stochastic rounding")
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.rounding = StochasticRounding(seed)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = _closure_loss(closure)
        for p, state, group in self._params_with_grads():
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["step"] += 1
            self._step_param(p, state, group)
        return loss

    def _step_param(self, p: torch.Tensor, state: dict, group: dict) -> None:
        """One AdamW step of ``p``, :data:`STEP_CHUNK` elements at a time (the update is
        elementwise): the float32 working copies of a 16-bit tensor then take a few chunks,
        not a few copies of the tensor (the 7B LM head's alone are 2 GB each)."""
        shard = _is_dtensor(p)  # (this rank's part only: its own rounding bits)
        tensors = tuple(_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
        if not all(t.is_contiguous() for t in tensors):
            return self._step_slice(*tensors, group, float(state["step"]), shard)
        flat = [t.view(-1) for t in tensors]
        for lo in range(0, flat[0].numel(), STEP_CHUNK):
            self._step_slice(*(t[lo : lo + STEP_CHUNK] for t in flat), group, float(state["step"]), shard)

    def _step_slice(self, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    group: dict, step: float, shard: bool = False) -> None:
        """The AdamW step of matching slices in float32 (in place where the tensors are float32)."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = grad.float()
        weight, m, v = p.float(), exp_avg.float(), exp_avg_sq.float()
        weight.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
        weight.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
        self._write(exp_avg, m, True, shard)
        self._write(exp_avg_sq, v, True, shard)
        self._write(p, weight, self.stochastic_rounding, shard)

    def _write(self, target: torch.Tensor, value: torch.Tensor, stochastic: bool, shard: bool) -> None:
        """Store the float32 ``value`` into ``target`` (the same tensor when it is float32)."""
        if value is target:
            return
        target.copy_(self.rounding(value, shard) if stochastic and target.dtype == torch.bfloat16 else value)

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        super().load_state_dict(state_dict)
        # torch casts floating-point state to its parameter's dtype; the moments keep state_dtype
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=self.state_dtype, copy=True)


class StochasticRoundingMuon(_RoundingOptimizer, torch.optim.Muon):
    """torch.optim.Muon over bf16 weights with the update written back by stochastic
    rounding (see :class:`LeanAdamW`): each matrix in turn is copied to float32, stepped by
    torch's own Muon step, and rounded back. The momentum buffer stays in the gradient's
    dtype, as torch.optim.Muon keeps it; the rounding's generator state is in
    :meth:`state_dict`."""

    def __init__(self, params, seed: int = 0, **muon_args) -> None:
        super().__init__(params, **muon_args)
        _check_bf16_params((p for g in self.param_groups for p in g["params"]), "stochastic rounding")
        self.rounding = StochasticRounding(seed)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = _closure_loss(closure)
        for p, state, group in self._params_with_grads():
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            weight = p.float()
            muon_step([weight], [p.grad], [state["momentum_buffer"]], lr=group["lr"],
                      weight_decay=group["weight_decay"], momentum=group["momentum"], nesterov=group["nesterov"],
                      ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], eps=group["eps"],
                      adjust_lr_fn=group["adjust_lr_fn"], has_complex=False)
            p.copy_(self.rounding(weight))
        return loss


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


def adamw(params: list[torch.Tensor], lr: float, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.999), state_dtype: torch.dtype = torch.float32,
          stochastic_rounding: bool = False, seed: int = 0) -> torch.optim.Optimizer:
    """torch.optim.AdamW, or :class:`LeanAdamW` where a memory option is on (bf16 moments,
    or bf16 weights stepped with stochastic rounding). Sharded and whole tensors together
    (a sharded learner) step one at a time: a multi-tensor kernel takes one kind."""
    if state_dtype == torch.float32 and not stochastic_rounding:
        mixed = len({_is_dtensor(p) for p in params}) > 1
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                                 foreach=False if mixed else None)
    return LeanAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, state_dtype=state_dtype,
                     stochastic_rounding=stochastic_rounding, seed=seed)


def build_optimizer(
    model: nn.Module | list[tuple[str, torch.Tensor]],
    name: str,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    muon_lr: float | None = None,
    state_dtype: torch.dtype = torch.float32,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> torch.optim.Optimizer:
    """AdamW, or Muon + AdamW, over a module's parameters or ``(name, tensor)`` pairs.

    ``state_dtype``: the dtype of AdamW's moments; ``stochastic_rounding``: the parameters
    are bf16 weights stepped directly, each write stochastically rounded (Muon's too)."""
    named = model.named_parameters() if isinstance(model, nn.Module) else model
    params = [(n, p) for n, p in named if p.requires_grad]
    lean = {"state_dtype": state_dtype, "stochastic_rounding": stochastic_rounding, "seed": seed}
    if name == "adamw":
        return adamw([p for _, p in params], lr, weight_decay, betas, **lean)
    if name == "muon":
        if not hasattr(torch.optim, "Muon"):
            raise ValueError("optim.name=muon needs torch >= 2.9 (torch.optim.Muon); use optim.name=adamw")
        hidden = [p for n, p in params if is_hidden_matrix(n, p)]
        rest = [p for n, p in params if not is_hidden_matrix(n, p)]
        muon_args = {"lr": muon_lr or lr, "weight_decay": weight_decay, "adjust_lr_fn": "match_rms_adamw"}
        opts: list[torch.optim.Optimizer] = [
            StochasticRoundingMuon(hidden, seed=seed, **muon_args) if stochastic_rounding
            else torch.optim.Muon(hidden, **muon_args)
        ]
        if rest:
            opts.append(adamw(rest, lr, weight_decay, betas, **lean))
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
        # (a sharded learner's sharded weights are float32 masters themselves: quarl.learner.sharded)
        self.pairs = [(n, p, p.detach().float().clone().requires_grad_(True))
                      for n, p in model.named_parameters() if p.requires_grad and not _is_dtensor(p)]

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


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's own shard (the elementwise step needs no other rank's), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t


def warmup_constant(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    )


def bytes_per_param(weight_dtype: torch.dtype, fp32_master: bool = True,
                    state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes one trained parameter takes at the AdamW step (activations not counted): the
    weight and its gradient in the model's dtype, for a 16-bit model with ``fp32_master``
    the float32 master and its float32 gradient, and the two moments in ``state_dtype``.
    bf16 + fp32 master + fp32 states: 2 + 2 + 4 + 4 + 4 + 4 = 20; bf16 stepped directly
    with bf16 states: 2 + 2 + 2 + 2 = 8."""
    weight = weight_dtype.itemsize
    master = 4 + 4 if fp32_master and weight < 4 else 0
    return 2 * weight + master + 2 * state_dtype.itemsize


def training_memory_bytes(n_params: int, weight_dtype: torch.dtype = torch.bfloat16, fp32_master: bool = True,
                          state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of weights, gradients and optimizer states of a full fine-tune of ``n_params``
    parameters with AdamW (:func:`bytes_per_param`)."""
    return n_params * bytes_per_param(weight_dtype, fp32_master, state_dtype)
