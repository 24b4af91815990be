"""The setup phase of a run: its parts built from the config, in order.

data (tokenizer, task, verifier pool)  ->  base model (loaded, warm-started or quantized
while loading)  ->  engine and publisher (the quantization mode shapes both models)  ->
learner (optimizer, reference model, critic; sharded over the ranks where asked).
``quarl eval`` builds the first three alone (:mod:`quarl.trainer.evaluation`).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quarl.config import RunConfig
from quarl.config.run import ModelConfig
from quarl.config.typed import dump_yaml, to_dict
from quarl.distributed import Dist
from quarl.io import write_text_atomic
from quarl.learner.learner import Critic, Learner
from quarl.model.transformer import Transformer
from quarl.rollout import Engine, EngineConfig
from quarl.runtime import DTYPES, matmul_rate
from quarl.tasks.tokenizer import load_tokenizer
from quarl.trainer.logger import MetricsLogger
from quarl.trainer.memory_policy import MemoryPolicy
from quarl.trainer.notices import Notices
from quarl.trainer.setup import build_base_model, build_task_and_rewards, solution_pairs
from quarl.trainer.step_metrics import LearnerWork
from quarl.trainer.weights import LoRAPublisher, LoRASettings, Publisher, build_engine_and_publisher


@dataclass
class RunData:
    """The task, its splits, the tokenizer, and the pool that scores completions with the
    task's verifier; ``solution_pairs``: the eval split's worked solutions, scored
    teacher-forced under the policy at each evaluation (none with ``trainer.eval_teacher_forced``
    off, or where the task has none)."""

    tokenizer: Any
    task: Any
    rewards: Any
    train_examples: list
    eval_examples: list
    solution_pairs: list


@dataclass
class Components:
    """What the training loop runs on."""

    data: RunData
    engine: Engine
    publisher: Publisher | LoRAPublisher
    learner: Learner
    memory: MemoryPolicy
    work: LearnerWork


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def build_data(cfg: RunConfig) -> RunData:
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    task, rewards = build_task_and_rewards(cfg.data)
    train_examples, eval_examples = task.train_examples(), task.eval_examples()
    pairs = solution_pairs(task, tokenizer) if cfg.trainer.eval_teacher_forced else []
    return RunData(tokenizer, task, rewards, train_examples, eval_examples, pairs)


def base_model(cfg: RunConfig, data: RunData, device: torch.device, dtype: torch.dtype, run_dir: Path, dist: Dist,
               notices: Notices, resuming: bool) -> Transformer:
    """:func:`~quarl.trainer.setup.build_base_model` on every rank. Where the base is cached on
    disk (a warm-start, a packed low-bit base) rank 0 makes it first and the others load it;
    otherwise every rank makes its own at once."""
    serial = cfg.trainer.sft_warmup_steps > 0 or cfg.model.packed_cache is not None
    if serial and not dist.main:
        dist.barrier()
    base = build_base_model(cfg, data.tokenizer, data.task, device, dtype, run_dir, notices.say, notices.console,
                            resuming=resuming)
    if serial and dist.main:
        dist.barrier()
    return base


def lora_settings(m: ModelConfig) -> LoRASettings | None:
    return LoRASettings(m.lora_rank, m.lora_scale_alpha, tuple(m.lora_targets)) if m.lora_rank else None


def engine_config(cfg: RunConfig) -> EngineConfig:
    r = cfg.rollout
    return dataclasses.replace(r.engine, max_model_len=cfg.data.max_prompt_len + r.max_new_tokens)


def build_engine(cfg: RunConfig, base: Transformer, dist: Dist, notices: Notices, kv_cache: bool = True
                 ) -> tuple[Engine, Publisher | LoRAPublisher]:
    """The engine in ``quant.scheme`` and the publisher that keeps it equal to ``base`` (which
    becomes the learner's model: :func:`~quarl.trainer.weights.build_engine_and_publisher`)."""
    # an MoE model's engine always records its experts: route agreement is measured every step,
    # replayed or not (rollout.routing_replay, docs/configuration.md)
    engine, publisher = build_engine_and_publisher(base, cfg.quant, engine_config(cfg), lora_settings(cfg.model),
                                                   dist, kv_cache=kv_cache, record_routes=base.config.is_moe)
    if cfg.rollout.routing_replay == "r3" and not base.config.is_moe:
        notices.say("rollout.routing_replay=r3: the model has no MoE layers, so there are no routes to replay "
                    "(nothing changes)")
    if engine.runner.dense_weight_bytes:
        notices.say(f"engine keeps its {cfg.quant.scheme.name} weights dense too: "
                    f"{engine.runner.dense_weight_bytes / 2**30:.1f} GB (rollout.engine.dense_weights)")
    return engine, publisher


def build_learner(cfg: RunConfig, model: Transformer, ref: Transformer | None, critic: Critic | None,
                  dist: Dist) -> Learner:
    o, t = cfg.optim, cfg.trainer
    return Learner(
        model, o.name, o.lr, o.weight_decay, tuple(o.betas), o.muon_lr, o.warmup_steps, ref, critic, o.fp32_master,
        t.compile, state_dtype=DTYPES[o.state_dtype], activation_checkpointing=t.activation_checkpointing,
        seed=t.seed, dist=dist, shard=t.shard_learner, routing_replay=cfg.rollout.routing_replay == "r3",
    )


def build_components(cfg: RunConfig, dist: Dist, device: torch.device, dtype: torch.dtype, run_dir: Path,
                     notices: Notices, resuming: bool) -> Components:
    """Every part of a training run (``resuming``: a checkpoint will overwrite the policy)."""
    data = build_data(cfg)
    base = base_model(cfg, data, device, dtype, run_dir, dist, notices, resuming)
    lora = lora_settings(cfg.model)
    if lora is not None and cfg.algo.kl_coef > 0:
        ref = None  # the reference of a LoRA policy is its base: the adapters switched off
    else:
        ref = copy.deepcopy(base).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
    # a learner sharded over the ranks frees most of the base once sharded: the engine sizes its
    # KV cache after that, from the memory free then (before, a 14B base alone took 35% of an H100)
    sharded = cfg.trainer.shard_learner and dist.world > 1
    engine, publisher = build_engine(cfg, base, dist, notices, kv_cache=not sharded)
    # the adapters (the base is frozen: perf/learner_mfu counts no weight grads)
    adapters = sum(p.numel() for p in base.parameters() if p.requires_grad) if lora is not None else None
    work = LearnerWork(base.config.matmul_params, adapters, matmul_rate(device))
    memory = MemoryPolicy(cfg.rollout.kv_cache_in_update, device, publisher.learner_model, engine, notices.say)
    critic = Critic(base) if cfg.algo.advantage == "gae" else None
    learner = build_learner(cfg, publisher.learner_model, ref, critic, dist)
    engine.reallocate_kv_cache()  # (a sharded run's engine sizes its cache now; else nothing to do)
    if learner.sharded:
        held, total = learner.held_parameters()
        notices.say(f"learner sharded over {dist.world} ranks (FSDP2): each holds {held / 1e6:.3g}M of the "
                    f"model's {total / 1e6:.3g}M parameters")
    elif cfg.trainer.shard_learner:
        notices.say("trainer.shard_learner: one process holds the whole learner (launch several ranks with "
                    "torchrun --nproc_per_node=N to shard it)")
    return Components(data, engine, publisher, learner, memory, work)


def start_logging(run_dir: Path, cfg: RunConfig, resume_step: int | None) -> MetricsLogger:
    """The run's files, written only once its checkpoint (if any) has loaded: ``config.yaml``
    and the metrics logger (``resume_step``: drop logged rows past it; None: a new run)."""
    write_text_atomic(run_dir / "config.yaml", dump_yaml(cfg))
    return MetricsLogger(run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project, to_dict(cfg),
                         resume_step=resume_step)

