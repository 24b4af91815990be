"""The learner: log-probs, the policy update with gradient accumulation, the critic.

The policy is a :class:`~quarl.model.Transformer` whose decoder linears are, in
``aligned`` mode, :class:`quarl.quant.QATLinear` (low-bit forward, straight-through
backward); the learner does not care which. A step is ``ppo_epochs`` passes over
``mini_batches`` mini-batches; each mini-batch is cut into micro-batches of at most
``token_budget`` padded tokens whose gradients are accumulated with weights that make
the sum equal to the loss over the whole mini-batch. Data-parallel ranks (``dist``) each hold
their share of the batch: the weights use the totals over all ranks and the gradients are
summed across them before the clip, so every rank steps as one process on the whole batch.
With ``shard`` the ranks also split the weights, gradients and optimizer states (FSDP2,
:mod:`quarl.learner.sharded`); what a learner trains, and its checkpointed state, is
:class:`~quarl.learner.trained.Trained` (the policy; the critic).

MoE policies (``rollout.routing_replay``, docs/configuration.md): with ``routing_replay`` every
forward of the policy and of the reference model (log-prob passes, update micro-batches and
their activation-checkpoint recomputation) runs the experts the engine ran for each token
(``RolloutBatch.routes``; tokens it never ran route themselves), the gate weights still the
router's own probabilities of them. A :class:`RouteTally` counts, over a pass where the policy
routes itself, how often its top-k equals the engine's.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from quarl.algos import compute_policy_loss, kl_penalty, masked_mean
from quarl.algos.losses import SEQUENCE_LOSSES
from quarl.distributed import DeviceTimer, Dist
from quarl.learner.batch import MicroBatch, Packing, RolloutBatch, micro_batches
from quarl.learner.logprobs import sequence_logprobs
from quarl.learner.optim import MasterWeights, adamw, build_optimizer, warmup_constant
from quarl.learner.sharded import reshard, shard_model
from quarl.learner.trained import Trained
from quarl.learner.compiled_ops import COMPILED_OPS
from quarl.learner.memory import drop_dense_bases
from quarl.model.lora import adapters_disabled, has_lora
from quarl.model.moe import MoeRouting, moe_layer_ids, moe_routing, replay_of
from quarl.model.transformer import TORCH_OPS, CheckpointedOps, TorchOps, Transformer, batch_attention
from quarl.quant.linear import deferred_master_grads, drop_dequantized, set_per_use_dequant


# the "format" of the plain part of a sharded learner's state (:meth:`Learner.sharded_state`)
SHARDED_FORMAT = "torch.distributed.checkpoint"


@dataclass
class UpdateSettings:
    """What one policy update does (the trainer builds it from AlgoConfig/TrainerConfig)."""

    loss_type: str = "tbpo"
    loss_hparams: dict = field(default_factory=dict)
    ppo_epochs: int = 1
    mini_batches: int = 1
    token_budget: int = 8192
    temperature: float = 1.0
    grad_clip: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    value_coef: float = 0.5


class RouteTally:
    """Counts on the device over the tokens of the passes it is handed to (no host sync until
    :meth:`metrics`), per MoE layer ``j`` (``layers[j]``): ``valid`` the tokens the engine ran
    (its routes known), ``agree`` those where the policy's own top-k set (its router's choice,
    whatever was replayed) equals the engine's, and ``load [L, E]`` the engine's token-slot
    assignments per expert."""

    def __init__(self, layers: list[int], num_experts: int, device: torch.device) -> None:
        self.layers, self.num_experts = layers, num_experts
        self.valid = torch.zeros(len(layers), dtype=torch.long, device=device)
        self.agree = torch.zeros_like(self.valid)
        self.load = torch.zeros(len(layers), num_experts, dtype=torch.long, device=device)

    def add(self, routing: MoeRouting, engine: torch.Tensor) -> None:
        """One forward's routing (it recorded) against the engine's routes ``engine [N, L, k]``
        of the same tokens (the forward's order)."""
        own = torch.stack([routing.router_ids[i] for i in self.layers], dim=1)
        engine = engine.long()
        known = (engine >= 0).all(-1)  # [N, L]
        same = (own.long().sort(-1).values == engine.sort(-1).values).all(-1) & known
        self.valid += known.sum(0)
        self.agree += same.sum(0)
        slot = engine.clamp(min=0) + self.num_experts * torch.arange(len(self.layers), device=engine.device)[:, None]
        weight = known[..., None].expand_as(engine).long()
        self.load.view(-1).scatter_add_(0, slot.reshape(-1), weight.reshape(-1))

    def metrics(self, dist: Dist, top_k: int) -> dict[str, float]:
        """``moe/route_agreement`` (over every layer) and ``moe/route_agreement_l{layer}``: the
        share of the engine's (token, layer) routes the policy's router picks as a set;
        ``moe/expert_load_max``: the busiest expert's share of a layer's token-slot assignments,
        the largest over the layers (``1 / E`` is a perfect balance). Counts summed over the
        ranks; nothing where no token had routes."""
        counts = dist.sum_tensor_(torch.cat([self.valid, self.agree, self.load.reshape(-1)]).double()).cpu()
        n = len(self.layers)
        valid, agree, load = counts[:n], counts[n : 2 * n], counts[2 * n :].view(n, -1)
        if valid.sum() == 0:
            return {}
        out = {"moe/route_agreement": float(agree.sum() / valid.sum()),
               "moe/expert_load_max": float((load.max(-1).values / (valid * top_k).clamp(min=1)).max())}
        out.update({f"moe/route_agreement_l{layer}": float(agree[j] / max(float(valid[j]), 1.0))
                    for j, layer in enumerate(self.layers)})
        return out


class Critic(nn.Module):
    """A value model for PPO with GAE: a transformer trunk with a scalar head."""

    def __init__(self, policy: Transformer) -> None:
        super().__init__()
        self.trunk = copy.deepcopy(policy)
        self.trunk.lm_head = None
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.to(device=policy.embed_tokens.weight.device, dtype=policy.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, right_padded: bool | None = None,
                ops: TorchOps | CheckpointedOps = TORCH_OPS) -> torch.Tensor:
        """Values ``[B, T-1]`` of the states that predict tokens 1..T-1 (``ops`` runs the trunk's layers)."""
        positions, attn = batch_attention(input_ids, attention_mask, right_padded=right_padded)
        h = self.trunk.hidden_states(input_ids, positions, attn, ops, max_position=input_ids.shape[1])[:, :-1]
        return self.head(h).squeeze(-1).float()


class Learner:
    """The policy (and critic) update of a :class:`~quarl.model.Transformer`.

    Memory options: ``fp32_master`` (a 16-bit model steps fp32 master copies; off, its bf16
    weights are stepped directly with stochastic rounding), ``state_dtype`` (the dtype of
    AdamW's moments, :class:`~quarl.learner.optim.LeanAdamW` for bf16) and
    ``activation_checkpointing`` (the forwards with gradients keep only each decoder layer's
    inputs and recompute the layer in the backward, :class:`~quarl.model.transformer.CheckpointedOps`;
    aligned linears then also dequantize per use, :func:`~quarl.quant.linear.set_per_use_dequant`).
    ``seed`` seeds the optimizer's stochastic rounding. ``shard`` (several ranks in ``dist``):
    the policy, a reference model and the critic's trunk sharded over the ranks.
    ``routing_replay`` (an MoE policy): its forwards run the engine's experts (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        optim_name: str = "adamw",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        muon_lr: float | None = None,
        warmup_steps: int = 0,
        ref_model: Transformer | None = None,
        critic: Critic | None = None,
        fp32_master: bool = True,
        compile_ops: bool = False,
        state_dtype: torch.dtype = torch.float32,
        activation_checkpointing: bool = False,
        seed: int = 0,
        dist: Dist = Dist(),
        shard: bool = False,
        routing_replay: bool = False,
    ) -> None:
        self.model = model
        self.dist = dist
        self.moe_layers = moe_layer_ids(model)  # (empty: a dense policy, nothing to replay)
        self.routing_replay = routing_replay and bool(self.moe_layers)
        self._tally: RouteTally | None = None  # the update's, while it runs
        # FSDP2 over the ranks (quarl.learner.sharded); one process has nothing to shard
        self.sharded = shard and dist.world > 1
        if self.sharded:
            if optim_name == "muon":
                raise ValueError("optim.name=muon orthogonalises whole matrices, which a sharded learner does not "
                                 "hold: use optim.name=adamw with trainer.shard_learner=true, or "
                                 "trainer.shard_learner=false")
            shard_model(model, dist, fp32_master)
            if ref_model is not None:
                shard_model(ref_model, dist, fp32_master=False)
            if critic is not None:  # (its trunk; the value head stays whole)
                shard_model(critic.trunk, dist, fp32_master)
        # compile_ops: the forward's elementwise steps through torch.compile (CUDA only)
        ops = COMPILED_OPS if compile_ops and self.device.type == "cuda" else TORCH_OPS
        self.ops = CheckpointedOps(ops) if activation_checkpointing else ops
        if activation_checkpointing:  # nor a dense copy of every quantized weight through the update
            set_per_use_dequant(model)
        self.critic_ops = CheckpointedOps(TORCH_OPS) if activation_checkpointing else TORCH_OPS
        self.ref_model = ref_model
        self.critic = critic
        dtype = model.compute_dtype
        self.master = MasterWeights(model) if dtype in (torch.bfloat16, torch.float16) and fp32_master else None
        # (sharded weights are masters themselves: in the model's order among the others)
        params = model if self.master is None else _stepped(model, self.master)
        # bf16 weights stepped directly: updates below one ulp survive only with stochastic rounding
        rounded = self.master is None and dtype == torch.bfloat16
        lean = {"state_dtype": state_dtype, "stochastic_rounding": rounded, "seed": seed}
        self.optimizer = build_optimizer(params, optim_name, lr, weight_decay, tuple(betas), muon_lr, **lean)
        self.scheduler = warmup_constant(self.optimizer, warmup_steps)
        self.last_nonfinite: list[str] = []  # metric names of the last skipped update
        self._grad_sync = DeviceTimer(self.device)  # several ranks: summing the gradients over them
        self.last_logp: torch.Tensor | None = None  # log-probs the last update's forward computed
        self.last_packing: Packing | None = None  # how the last update's micro-batches used the budget (this rank's)
        self.critic_master = MasterWeights(critic) if critic is not None and self.master is not None else None
        self.critic_optimizer = adamw([t for _, t in _stepped(critic, self.critic_master)], lr, weight_decay,
                                      **lean) if critic is not None else None
        self.policy = Trained(model, self.optimizer, self.master, self.sharded, adapters_only=has_lora(model))
        self.value = None if critic is None else Trained(critic, self.critic_optimizer, self.critic_master,
                                                          self.sharded)

    def held_parameters(self) -> tuple[int, int]:
        """The policy's parameters this rank holds (its shards and the replicated ones), and all of them."""
        return self.policy.held()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def route_tally(self) -> RouteTally | None:
        """A fresh :class:`RouteTally` of the policy's MoE layers (None: a dense policy)."""
        if not self.moe_layers:
            return None
        return RouteTally(self.moe_layers, self.model.config.num_experts, self.device)

    @contextlib.contextmanager
    def _routing(self, model: nn.Module, mb: RolloutBatch, replay: bool,
                 tally: RouteTally | None) -> Iterator[None]:
        """The forwards (and backward) of micro-batch ``mb`` by ``model`` run inside: the
        engine's routes replayed where ``replay``, the routing counted into ``tally``. Nothing
        without routes (a dense model, a batch the engine did not record)."""
        if mb.routes is None or not self.moe_layers or not (replay or tally is not None):
            yield
            return
        routes = mb.routes.to(self.device, non_blocking=True)  # [b, w, L, k]: the forward's token order
        with moe_routing(model, replay_of(routes, self.moe_layers) if replay else None,
                         record=tally is not None) as routing:
            yield
        if tally is not None:
            tally.add(routing, routes.reshape(-1, *routes.shape[-2:]))

    # ---- forward passes -------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, token_budget: int, temperature: float = 1.0, ref: bool = False,
                 replay: bool | None = None, tally: RouteTally | None = None):
        """Log-probs ``[B, T-1]`` of the batch's tokens under the policy (or the reference: the
        ``ref_model``, or for a LoRA policy without one its base, adapters off). An MoE model
        replays the batch's routes where ``replay`` (None: ``routing_replay``; the reference
        too: its log-probs are of the same samples, which the engine drew on those routes) and
        counts its routing into ``tally``."""
        replay = self.routing_replay if replay is None else replay
        if ref and self.ref_model is None:
            if not has_lora(self.model):
                raise ValueError("no reference model: pass ref_model (algo.kl_coef > 0 needs one)")
            with adapters_disabled(self.model):
                return self.logprobs(batch, token_budget, temperature, replay=replay)
        model = self.ref_model if ref else self.model

        def logp(mb: RolloutBatch) -> torch.Tensor:
            with self._routing(model, mb, replay, tally):
                return sequence_logprobs(model, mb.input_ids, mb.attention_mask, temperature=temperature,
                                         ops=self.ops, right_padded=True)[0]

        out = _per_response_token(batch, token_budget, logp)
        if self.sharded:
            reshard(model)  # (not held gathered through the rollout)
        return out

    @torch.no_grad()
    def values(self, batch: RolloutBatch, token_budget: int) -> torch.Tensor:
        """The critic's values ``[B, T-1]`` of the states that predict response tokens."""
        out = _per_response_token(batch, token_budget,
                                  lambda mb: self.critic(mb.input_ids, mb.attention_mask, right_padded=True))
        self.value.resharded()
        return out

    # ---- the update -----------------------------------------------------------------
    def release_caches(self) -> None:
        """Free the dequantized weights the model's quantized linears keep between forwards
        (and a LoRA learner's frozen base, when it keeps it dense through an update)."""
        drop_dequantized(self.model)
        drop_dense_bases(self.model)

    def update(self, batch: RolloutBatch, s: UpdateSettings, returns: torch.Tensor | None = None,
               tally: RouteTally | None = None) -> dict[str, float]:
        """``ppo_epochs`` x ``mini_batches`` optimizer steps on ``batch`` (already on device).

        ``batch.old_logp`` may be None only for a single optimizer step (one epoch, one
        mini-batch): then the update's own forward is the proximal policy, its detached
        log-probs serve as ``old_logp`` and are left in ``self.last_logp`` ``[B, T-1]``, and
        its routing may be counted into ``tally`` (each row once).
        """
        if batch.old_logp is None and (s.ppo_epochs, s.mini_batches) != (1, 1):
            raise ValueError("old_logp is required when one batch makes several optimizer steps")
        if tally is not None and (s.ppo_epochs, s.mini_batches) != (1, 1):
            raise ValueError("a route tally of the update needs one optimizer step (each row once)")
        self._tally = tally
        self.last_logp = torch.zeros_like(batch.sampler_logp)
        self.last_packing = None
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        skipped = 0
        n = batch.size
        per_mb = math.ceil(n / s.mini_batches)
        for _epoch in range(s.ppo_epochs):
            for start in range(0, n, per_mb):
                rows = torch.arange(start, min(n, start + per_mb), device=batch.input_ids.device)
                metrics, ok = self._mini_batch_step(batch, rows, s, returns)
                skipped += 0 if ok else 1
                for k, v in metrics.items():
                    if math.isfinite(v):
                        sums[k] = sums.get(k, 0.0) + v
                        counts[k] = counts.get(k, 0) + 1
        self._tally = None
        self.release_caches()  # stale after the optimizer step; not kept through the rollout
        out = {k: sums[k] / counts[k] for k in sums}
        out["train/skipped_updates"] = float(skipped)
        if self.dist.world > 1:
            out["time/grad_sync"] = self._grad_sync.take()
        return out

    def _mini_batch_step(
        self, batch: RolloutBatch, rows: torch.Tensor, s: UpdateSettings, returns: torch.Tensor | None
    ) -> tuple[dict[str, float], bool]:
        """Accumulate the gradients of the mini-batch ``rows`` over its micro-batches, then one
        optimizer step. The micro-batches' sizes and weights are known on the host and their
        metrics stay on the device until all of them are queued: the host reads the device
        once per mini-batch (the step's finiteness check), not several times per micro-batch."""
        rows = batch.longest_first(rows)  # like lengths share a micro-batch: little padding
        mini = batch.select(rows)
        ret = returns[rows] if returns is not None else None
        seq_loss = s.loss_type in SEQUENCE_LOSSES
        token_mean = not seq_loss and s.loss_hparams.get("agg", "token-mean") == "token-mean"
        parts = micro_batches(mini, s.token_budget)
        packing = Packing.of(parts, s.token_budget)
        self.last_packing = packing if self.last_packing is None else self.last_packing.merged(packing)
        # the mini-batch is the union of every rank's rows: its totals are summed over the ranks
        # (rows with no response token, e.g. removed by a correction, leave the sequence means' count)
        tokens, rows_with_tokens = self.dist.sum([sum(mb.response_tokens for mb in parts),
                                                  sum(mb.response_rows for mb in parts)])
        total_tokens, total_rows = max(tokens, 1), max(rows_with_tokens, 1)
        hparams = dict(s.loss_hparams)
        if s.loss_hparams.get("agg") == "seq-mean-token-sum-norm":
            hparams.setdefault("max_len", self.dist.max(max([mb.longest_response for mb in parts] + [1])))
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.model.zero_grad(set_to_none=True)
        if self.critic_optimizer is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
            self.critic.zero_grad(set_to_none=True)
        names: list[str] = []
        acc: torch.Tensor | None = None  # the metrics of every micro-batch, weighted and summed on the device
        # aligned linears hand their gradient to the master weights once, after the last micro-batch
        with deferred_master_grads(self.model):
            for part in parts:
                # Weight of this micro-batch in the mini-batch's mean (exact for token-mean and
                # the sequence means, since each micro-batch normalises by its own count).
                weight = part.response_tokens / total_tokens if token_mean else part.response_rows / total_rows
                m = self._micro_batch_backward(mini, part, rows[part.lo : part.hi], s, hparams, ret, weight)
                names = list(m)  # (every micro-batch reports the same names)
                term = torch.stack([v.double().reshape(()) for v in m.values()]) * weight
                acc = term if acc is None else acc + term
        drop_dequantized(self.model)  # stale at the step: not held through it (frozen bases stay)
        if self.master is not None:
            self.master.grads_to_masters()
        # the weighted losses of all ranks add up to the mini-batch's: so do their grads and metrics
        if acc is not None:
            acc = self.dist.sum_tensor_(acc)
        grad_norm = self.policy.sum_and_clip(self.dist, s.grad_clip, self._grad_sync).double().reshape(1)
        values = grad_norm if acc is None else torch.cat([acc, grad_norm])
        metrics = dict(zip(names + ["grad_norm"], values.tolist()))  # the one read of the device here
        self.last_nonfinite = sorted(k for k, v in metrics.items() if not math.isfinite(v))
        ok = not self.last_nonfinite
        if ok:
            self.optimizer.step()
            self.scheduler.step()
            if self.master is not None:
                self.master.masters_to_model()
            if self.critic_optimizer is not None:
                if self.critic_master is not None:
                    self.critic_master.grads_to_masters()
                self.value.sum_and_clip(self.dist, s.grad_clip)
                self.critic_optimizer.step()
                if self.critic_master is not None:
                    self.critic_master.masters_to_model()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.model.zero_grad(set_to_none=True)
        return metrics, ok

    def _micro_batch_backward(self, mini: RolloutBatch, part: MicroBatch, rows: torch.Tensor, s: UpdateSettings,
                              hparams: dict, returns: torch.Tensor | None, weight: float) -> dict[str, torch.Tensor]:
        """Forward, loss and backward of one micro-batch (rows ``part`` of ``mini``; ``rows``
        their indices in the whole batch), its loss scaled by ``weight``. Returns its metrics
        as 0-d device tensors. An MoE policy replays the engine's routes in the forward and in
        the backward's recomputation (activation checkpointing) alike."""
        mb = mini.rows(part)
        with self._routing(self.model, mb, self.routing_replay, self._tally):
            return self._micro_batch_loss(mb, part, rows, s, hparams, returns, weight)

    def _micro_batch_loss(self, mb: RolloutBatch, part: MicroBatch, rows: torch.Tensor, s: UpdateSettings,
                          hparams: dict, returns: torch.Tensor | None, weight: float) -> dict[str, torch.Tensor]:
        logp, entropy = sequence_logprobs(
            self.model, mb.input_ids, mb.attention_mask, temperature=s.temperature, with_entropy=True,
            ops=self.ops, right_padded=True,
        )
        mask = mb.response_mask
        old = mb.old_logp if mb.old_logp is not None else logp.detach()
        self.last_logp[rows, : logp.shape[1]] = logp.detach().float() * mask
        loss, m = compute_policy_loss(
            s.loss_type, logp=logp, old_logp=old, sampler_logp=mb.sampler_logp,
            advantages=mb.advantages, mask=mask, on_device=True, **hparams,
        )
        m["entropy"] = masked_mean(entropy, mask).detach()
        if s.kl_coef > 0 and mb.ref_logp is not None:
            kl = masked_mean(kl_penalty(logp, mb.ref_logp, s.kl_estimator, mask), mask)
            loss = loss + s.kl_coef * kl
            m["loss/kl"] = kl.detach()
        if self.critic is not None and returns is not None:
            v = self.critic(mb.input_ids, mb.attention_mask, right_padded=True, ops=self.critic_ops)
            v_loss = 0.5 * masked_mean((v - returns[part.lo : part.hi, : v.shape[1]]) ** 2, mask)
            loss = loss + s.value_coef * v_loss
            m["loss/value"] = v_loss.detach()
        (loss * weight).backward()
        return m

    # ---- state ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Whole tensors (:meth:`Trained.state_dict`; a sharded learner gathers them on every
        rank): the policy's ``model``, ``optimizer``, ``master``, the ``scheduler``, and the
        critic's as ``critic``, ``critic_optimizer``, ``critic_master``."""
        sd = {**self.policy.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.value is not None:
            sd.update((CRITIC_KEYS[k], v) for k, v in self.value.state_dict().items())
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.policy.load_state_dict(sd)
        self.scheduler.load_state_dict(sd["scheduler"])
        if self.value is not None and "critic" in sd:
            self.value.load_state_dict({k: sd[c] for k, c in CRITIC_KEYS.items() if c in sd})

    def sharded_state(self, allocate: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """The learner's state for ``torch.distributed.checkpoint``: its tensors by name, each
        rank's shards of the sharded ones (:meth:`Trained.dcp_tensors`; the critic's under
        ``critic/``), and the rest as plain values (optimizer settings, scheduler). The names
        do not depend on the number of ranks or on sharding, so any learner loads any such
        checkpoint (:meth:`load_sharded_state`). ``allocate``: create the optimizer states a
        fresh learner does not have yet, for a load to fill in place."""
        tensors = self.policy.dcp_tensors("", allocate)
        rest = {"format": SHARDED_FORMAT, **self.policy.dcp_rest(), "scheduler": self.scheduler.state_dict(),
                "model_dtype": str(self.model.compute_dtype).removeprefix("torch.")}
        if self.value is not None:
            tensors.update(self.value.dcp_tensors("critic/", allocate))
            rest["critic_optimizer"] = self.value.dcp_rest()
        if not allocate:  # each rank's rounding bits, in rank order (a collective: every rank saves)
            rest["rounding"] = self.dist.gather(rest["rounding"])
            if self.value is not None:
                rest["critic_optimizer"]["rounding"] = self.dist.gather(rest["critic_optimizer"]["rounding"])
        return tensors, rest

    def load_sharded_state(self, checkpoint: str | Path, rest: dict) -> None:
        """Load a checkpoint that :meth:`sharded_state` wrote with ``torch.distributed.checkpoint``
        into this learner, whatever its number of ranks or sharding: each rank reads the parts
        of the saved tensors that its own tensors cover, in place."""
        import torch.distributed.checkpoint as dcp

        tensors, _ = self.sharded_state(allocate=True)
        with warnings.catch_warnings():  # (one process: no process group, and none needed)
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=self.dist.world == 1)
        self.policy.after_dcp_load(self._own_rounding(rest))
        self.scheduler.load_state_dict(rest["scheduler"])
        if self.value is not None:
            self.value.after_dcp_load(self._own_rounding(rest["critic_optimizer"]))

    def _own_rounding(self, rest: dict) -> dict:
        """``rest`` with this rank's saved rounding state of :meth:`sharded_state`'s list. A rank
        the saving run did not have takes rank 0's shared generator (whole tensors must stay
        equal on every rank) and a fresh one for its shards (on other ranks' shards than the
        saving run's, those bits could not repeat its own anyway)."""
        by_rank = rest.get("rounding")
        if not isinstance(by_rank, list):
            return rest
        if self.dist.rank < len(by_rank) or by_rank[0] is None:  # (None: no rounding)
            return {**rest, "rounding": by_rank[min(self.dist.rank, len(by_rank) - 1)]}
        return {**rest, "rounding": {k: v for k, v in by_rank[0].items() if not k.endswith("/shard")}}


# the critic's state under the learner's state dict keys
CRITIC_KEYS = {"model": "critic", "optimizer": "critic_optimizer", "master": "critic_master"}


def _stepped(module: nn.Module, master: MasterWeights | None) -> list[tuple[str, torch.Tensor]]:
    """What an optimizer steps for ``module``'s trainable parameters, by name and in order: each
    one's float32 master where ``master`` holds it, else the parameter (a sharded one is its own)."""
    masters = dict(master.named_masters()) if master is not None else {}
    return [(n, masters.get(n, p)) for n, p in module.named_parameters() if p.requires_grad]


def _per_response_token(batch: RolloutBatch, token_budget: int, fn) -> torch.Tensor:
    """``fn`` over micro-batches (rows longest first: :meth:`RolloutBatch.longest_first`),
    gathered into ``[B, T-1]`` (0 off the response tokens)."""
    out = torch.zeros_like(batch.sampler_logp)
    order = batch.longest_first(torch.arange(batch.size, device=batch.input_ids.device))
    ordered = batch.select(order)
    for part in micro_batches(ordered, token_budget):
        mb = ordered.rows(part)
        v = fn(mb)
        out[order[part.lo : part.hi], : v.shape[1]] = v.float() * mb.response_mask
    return out
