"""What the learner trains, as one unit of state: a module, its optimizer and the float32
masters the optimizer steps (the policy; the critic), whole on every rank or sharded.

Two forms of that state, both independent of the number of ranks and of sharding, so a
checkpoint of one run resumes in any other:

* whole tensors (:meth:`Trained.state_dict`, ``state.pt``): ``model`` (the module's state in
  its dtype), ``master`` (float32 masters by parameter name), ``optimizer`` (the optimizer's
  own state dict, its states whole); a sharded part gathers them on every rank;
* ``torch.distributed.checkpoint`` (:meth:`Trained.dcp_tensors`): the same tensors by name,
  each rank holding its shards (``model/<name>`` where no master holds the value,
  ``master/<name>``, ``optim/<name>/<state>``), loaded in place by any learner.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from quarl.distributed import DeviceTimer, Dist
from quarl.learner.optim import CombinedOptimizer, MasterWeights
from quarl.learner.sharded import as_sharded_like, clip_grad_norm_, full, is_sharded, load_full_, reshard
from quarl.model.transformer import Transformer


@dataclass
class Trained:
    """``module`` stepped by ``optimizer`` (through ``master`` for a 16-bit module with float32
    masters); ``sharded``: its units are FSDP2's (:mod:`quarl.learner.sharded`); ``adapters_only``:
    its state is its trainable tensors alone (a LoRA policy: the frozen base is rebuilt from the
    run's config)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    master: MasterWeights | None
    sharded: bool = False
    adapters_only: bool = False

    # ---- the step ---------------------------------------------------------------------
    def stepped(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, in the order of :meth:`names`."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def names(self) -> list[str]:
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    def sum_and_clip(self, dist: Dist, max_norm: float, timer: DeviceTimer | None = None) -> torch.Tensor:
        """The masters' gradients summed over the ranks (a sharded weight's were summed by its
        reduce-scatter; ``timer`` times the sums) and clipped to ``max_norm`` together; the
        norm before the clip."""
        stepped = self.stepped()
        if dist.world > 1:
            with timer.timed() if timer is not None else contextlib.nullcontext():
                dist.sum_grads_(p for p in stepped if p.requires_grad and not is_sharded(p))
        if self.sharded:
            return clip_grad_norm_(stepped, max_norm, dist)
        return torch.nn.utils.clip_grad_norm_(stepped, max_norm)

    def resharded(self) -> None:
        """Every sharded unit back in shards (a root stays gathered after a forward without
        gradients); the parameters are then each rank's shards."""
        if self.sharded:
            reshard(self.module)

    def held(self) -> tuple[int, int]:
        """The parameters this rank holds (its shards and the whole ones), and all of them."""
        self.resharded()
        params = list(self.module.parameters())
        return (sum(p.to_local().numel() if is_sharded(p) else p.numel() for p in params),
                sum(p.numel() for p in params))

    # ---- whole tensors ----------------------------------------------------------------
    def module_state(self) -> dict[str, torch.Tensor]:
        if not self.adapters_only:
            return self.module.state_dict()
        return {n: p.detach() for n, p in self.module.named_parameters() if p.requires_grad}

    @property
    def compute_dtype(self) -> torch.dtype:
        trunk = self.module if isinstance(self.module, Transformer) else self.module.trunk
        return trunk.compute_dtype

    def state_dict(self) -> dict:
        """``{"model", "optimizer"[, "master"]}`` as whole tensors (a sharded part gathers them:
        every rank must call this)."""
        self.resharded()
        sd = {"model": self.module_state(), "optimizer": self.optimizer.state_dict()}
        if self.master is not None:
            sd["master"] = self.master.state_dict()
        if self.sharded:
            dtype = self.compute_dtype
            sd["model"] = {k: full(v, dtype if is_sharded(v) else None) for k, v in sd["model"].items()}
            if self.master is not None:
                sd["master"].update((n, full(p)) for n, p in self.module.named_parameters()
                                    if p.requires_grad and is_sharded(p))
            opt = sd["optimizer"]
            opt["state"] = {i: {k: full(v) for k, v in st.items()} for i, st in opt["state"].items()}
        return sd

    def check_names(self, model_sd: dict, what: str, why: str = "") -> None:
        want = set(self.module_state())
        if set(model_sd) != want:
            missing, extra = sorted(want - set(model_sd)), sorted(set(model_sd) - want)
            raise KeyError(f"the checkpoint's {what} (missing {missing[:3]}, unexpected {extra[:3]}){why}")

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """:meth:`state_dict`'s form, from any run (sharded or not): a sharded part copies its
        shards out of the whole tensors (the float32 master where the sharded weight is one)."""
        if self.sharded:
            self.check_names(sd["model"], "tensors do not match this model")
            self.resharded()
            targets = {**dict(self.module.named_buffers()), **dict(self.module.named_parameters())}
            masters = sd.get("master", {}) if self.master is not None else {}
            for name, value in sd["model"].items():
                target = targets[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise RuntimeError(f"size mismatch for {name}: the checkpoint has {tuple(value.shape)}, this "
                                       f"model {tuple(target.shape)}")
                load_full_(target, masters.get(name, value) if is_sharded(target) else value)
        elif self.adapters_only:
            self.check_names(sd["model"], "adapters do not match this LoRA model",
                             ": it was written with other model.lora_* settings")
            self.module.load_state_dict(sd["model"], strict=False)
        else:
            self.module.load_state_dict(sd["model"])
        if self.master is not None:
            self.master.load_state_dict(sd["master"])
        opt = sd["optimizer"]
        if self.sharded:  # whole states placed as their sharded parameters are
            params = self.stepped()
            opt = {**opt, "state": {i: {k: as_sharded_like(v, params[i])
                                        if is_sharded(params[i]) and v.shape == params[i].shape else v
                                        for k, v in st.items()} for i, st in opt["state"].items()}}
        self.optimizer.load_state_dict(opt)

    # ---- torch.distributed.checkpoint --------------------------------------------------
    def dcp_tensors(self, prefix: str = "", allocate: bool = False) -> dict[str, torch.Tensor]:
        """The part's tensors by name for ``torch.distributed.checkpoint`` (module docstring),
        after ``prefix``; ``allocate``: create the optimizer states a fresh part does not have
        yet (zeros), for a load to fill in place."""
        if isinstance(self.optimizer, CombinedOptimizer):
            raise ValueError("checkpoints through torch.distributed.checkpoint take AdamW (optim.name=adamw)")
        self.resharded()
        names = self.names()
        tensors = {f"{prefix}model/{n}": t for n, t in self.module_state().items()
                   if self.master is None or n not in names}
        for n, p in zip(names, self.stepped()):
            if self.master is not None:
                tensors[f"{prefix}master/{n}"] = p
            state = self.optimizer.state[p]
            if allocate and not state:
                moments = getattr(self.optimizer, "state_dtype", p.dtype)
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, dtype=moments),
                             exp_avg_sq=torch.zeros_like(p, dtype=moments))
            tensors.update((f"{prefix}optim/{n}/{k}", v) for k, v in state.items() if isinstance(v, torch.Tensor))
        return tensors

    def dcp_rest(self) -> dict:
        """The optimizer's settings and random state: what :meth:`dcp_tensors` leaves out."""
        opt = self.optimizer.state_dict()
        return {"param_groups": opt["param_groups"], "rounding": opt.get("rounding")}

    def after_dcp_load(self, rest: dict) -> None:
        """Finish a load of :meth:`dcp_tensors` (done in place): the module from its masters,
        the optimizer's settings and random state from ``rest`` (:meth:`dcp_rest`)."""
        from quarl.quant.linear import invalidate_quantized

        if self.master is not None:
            self.master.masters_to_model()
        invalidate_quantized(self.module)
        for group, saved in zip(self.optimizer.param_groups, rest["param_groups"]):
            group.update((k, v) for k, v in saved.items() if k != "params")
        if rest.get("rounding") is not None:
            self.optimizer.rounding.load_state_dict(rest["rounding"])
