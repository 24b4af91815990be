"""The run configuration of ``quarl train``: one section per package.

Defaults are the built-in demo run (a small model, built-in tokenizer, synthetic
arithmetic, aligned W4A16 with TBPO). Override from YAML (``--config run.yaml``) and
dotted flags (``--rollout.temperature=0.8``); ``quarl train --dry-run`` prints the
resolved configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from quarl.config.typed import ConfigError, closest, from_dict, merge, parse_overrides, read_yaml
from quarl.model.lora import ALL_TARGETS as LORA_TARGET_NAMES
from quarl.model.lora import DEFAULT_TARGETS as LORA_TARGETS
from quarl.model.lora import EXPERT_TARGET as LORA_EXPERT_TARGET
from quarl.quant.mode import QuantMode
from quarl.quant.scheme import SCHEMES, QuantScheme
from quarl.rollout.config import EngineConfig

# The range checks below skip None: an optional field left unset takes its user's own default.
# Each comparison is written so that NaN fails it.

def _at_least(section: str, obj: object, minimum: float, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value >= minimum:
            raise ConfigError(
                f"{section}.{name} must be >= {minimum}, got {value}: set --{section}.{name} to {minimum} or more"
            )


EXACT_UPDATES = ("recompute", "autograd")  # quant.exact_update


def _positive(section: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{section}.{name} must be > 0, got {value}: set --{section}.{name} to a positive number")


def _within(section: str, obj: object, name: str, low: float, high: float, *, open_low: bool = False,
            open_high: bool = False, meaning: str = "") -> None:
    """``section.name`` in the interval from ``low`` to ``high`` (each end closed unless open)."""
    value = getattr(obj, name)
    if value is None:
        return
    above = value > low if open_low else value >= low
    below = value < high if open_high else value <= high
    if not (above and below):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ConfigError(f"{section}.{name} must be in {interval}, got {value}{meaning}: set --{section}.{name} "
                          f"to a value in {interval}")


@dataclass
class ModelConfig:
    path: str | None = None  # HF checkpoint dir; None = built-in model of `builtin` size
    # tiny / small / 100m: the demo's (built-in tokenizer); the released shapes: random weights, for benchmarks
    builtin: Literal["tiny", "small", "100m", "moe-tiny", "moe-100m", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b",
                     "qwen2.5-32b", "qwen3-8b", "qwen3-30b-a3b"] = "small"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    tokenizer: str | None = None  # HF tokenizer dir; None = the model dir, or the built-in one; "builtin"
    # LoRA (docs/lora.md): > 0 trains adapters of this rank on a frozen base held
    # in quant.scheme (engine and learner share it); 0 = full fine-tune
    lora_rank: int = 0
    lora_alpha: float | None = None  # None = 2 * lora_rank (adapter scaling alpha / rank = 2)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # a LoRA run's base from model.path is quantized while it loads; this directory keeps the packed
    # base for the next run (keyed by the checkpoint files, scheme, selection, dtype; None = no cache)
    packed_cache: str | None = None

    @property
    def lora_scale_alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    def validate(self) -> None:
        _at_least("model", self, 0, "lora_rank")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"model.lora_alpha must be > 0, got {self.lora_alpha} (or leave it unset: 2 * lora_rank)")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGET_NAMES]
        if unknown or not self.lora_targets:
            hint = "".join(f"; {t!r}{closest(t, list(LORA_TARGET_NAMES))}" for t in unknown)
            raise ConfigError(f"model.lora_targets {self.lora_targets}: each must be one of "
                              f"{', '.join(LORA_TARGET_NAMES)}{hint}")
        if self.lora_rank and LORA_EXPERT_TARGET in self.lora_targets and self._is_moe() is False:
            raise ConfigError(f"model.lora_targets names {LORA_EXPERT_TARGET!r}, the experts of MoE layers, but "
                              f"{self.path or 'model.builtin=' + self.builtin} is a dense model; drop it (dense "
                              f"targets: {', '.join(LORA_TARGETS)})")

    def _is_moe(self) -> bool | None:
        """Whether the model is a mixture of experts (None: its config cannot be read here)."""
        from quarl.model.config import TransformerConfig
        from quarl.model.presets import preset_config

        try:
            return (TransformerConfig.from_dir(self.path) if self.path else preset_config(self.builtin)).is_moe
        except (OSError, ValueError, KeyError):
            return None


@dataclass
class DataConfig:
    task: Literal["arith", "countdown", "cycle", "file"] = "arith"
    path: str | None = None  # JSONL or parquet when task == "file"
    eval_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    difficulty: int = 1  # synthetic tasks: number of operations / operands
    num_train: int = 256  # the demo's RL gain on a small model comes from revisiting problems
    num_eval: int = 64
    seed: int = 0
    max_prompt_len: int = 256
    system_prompt: str | None = None
    reward: str = "builtin"  # "builtin" (the task's verifier), "math" (math-verify) or "module:function"
    reward_timeout_s: float = 5.0
    reward_workers: int = 2

    def validate(self) -> None:
        if self.task == "file" and not self.path:
            raise ConfigError("data.path is required when data.task is 'file' (a .jsonl or .parquet file)")
        _at_least("data", self, 1, "num_train", "difficulty", "max_prompt_len")
        _at_least("data", self, 0, "reward_workers", "num_eval")  # num_eval 0: no held-out split
        _positive("data", self, "reward_timeout_s")
        if self.reward not in ("builtin", "math"):
            from quarl.tasks.rewards import resolve_reward

            resolve_reward(self.reward)  # a module that cannot be imported fails now, before any model is built


def _trainer_engine() -> EngineConfig:
    # the learner shares the GPU: the process may hold 35% of it once the KV cache exists
    return EngineConfig(gpu_memory_utilization=0.35)


@dataclass
class RolloutConfig:
    """Sampling settings plus the engine's own config (``rollout.engine.*``, one
    :class:`~quarl.rollout.EngineConfig`). The trainer sets the engine's
    ``max_model_len`` to ``data.max_prompt_len + rollout.max_new_tokens``.

    ``rollout.engine.kv_cache_dtype=fp8`` stores the rollout's K/V as e4m3 codes with
    per-(token, kv head) scales (:mod:`quarl.quant.kv`); with ``quant.mode=aligned`` the
    learner's attention then rounds its K/V the same way, in ``bf16`` and ``rollout``
    modes the rounding is part of the rollout-only mismatch."""

    n: int = 8  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 48
    # the KV cache and decode graphs through the learner phase: "keep" them, "release" them
    # (re-created after, ~1 s on a 1.5B model), or "auto": on GPU, release at step 1, then keep
    # from step 2 when the learner's step-1 peak plus the cache fit in 90% of the GPU
    kv_cache_in_update: Literal["auto", "keep", "release"] = "auto"
    # MoE models: "r3" makes every learner forward run the experts the engine ran for each token
    # (rollout routing replay; docs/configuration.md); "off" lets the learner route itself. A dense
    # model has nothing to replay: r3 is then a no-op, announced once at start
    routing_replay: Literal["off", "r3"] = "off"
    engine: EngineConfig = field(default_factory=_trainer_engine)

    _moved = {  # old key -> where it lives now
        "kv_cache_fraction": "rollout.engine.gpu_memory_utilization (a fraction of the GPU's total memory that "
                             "the process may hold once the KV cache exists; docs/configuration.md)",
        "num_kv_blocks": "rollout.engine.num_kv_blocks", "block_size": "rollout.engine.block_size",
        "max_num_seqs": "rollout.engine.max_num_seqs", "cuda_graphs": "rollout.engine.cuda_graphs",
        "release_kv_cache": "rollout.kv_cache_in_update=release (or keep, or auto: the default)",
        "kv_cache_dtype": "rollout.engine.kv_cache_dtype (auto or fp8)",
    }

    def validate(self) -> None:
        _at_least("rollout", self, 1, "n")
        _within("rollout.engine", self.engine, "gpu_memory_utilization", 0, 1, open_low=True,
                meaning=" (a share of the GPU's memory)")
        _at_least("rollout.engine", self.engine, 1, "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "num_kv_blocks", "max_graph_batch", "top_p_candidates")
        if self.engine.max_model_len is not None:
            raise ConfigError("rollout.engine.max_model_len is set by the trainer (data.max_prompt_len + "
                              "rollout.max_new_tokens): set those instead")
        _at_least("rollout", self, 1, "max_new_tokens")
        _at_least("rollout", self, 0, "temperature")
        _within("rollout", self, "top_p", 0, 1, open_low=True, meaning=" (1 = no nucleus cut)")
        if self.routing_replay not in ("off", "r3"):
            raise ConfigError(f"rollout.routing_replay must be off or r3, got {self.routing_replay!r}")


@dataclass
class QuantConfig:
    """Resolved when the config loads: ``mode`` a :class:`QuantMode`, ``scheme`` a
    :class:`QuantScheme` (``bf16`` whenever the mode is ``bf16``)."""

    mode: QuantMode = QuantMode.ALIGNED
    scheme: QuantScheme = field(default_factory=lambda: SCHEMES["w4a16"])
    uaq_scale: float = 1.0  # QuRL's invariant scaling s (1.0 = off; the paper uses 1.5)
    include: list[str] = field(default_factory=lambda: ["layers.*"])
    exclude: list[str] = field(default_factory=list)
    # exact mode: engine and learner run the batch-invariant kernels (quarl/quant/kernels/invariant*.py)
    # for every op of the forward they share, so that the learner recomputes the sampler's log-probs bit
    # for bit. bf16 mode, or aligned mode with w4a16 / w4a16-asym / w2a16, on dense models only: other
    # settings are refused when the config loads, naming why
    exact: bool = False
    # how exact mode's update forward gets its gradients (the values are the invariant forward's either
    # way): "recompute", the invariant ops without autograd, then each layer's ordinary ops recomputed
    # in the backward (one more forward of every GEMM); "autograd", the invariant ops under autograd
    # (each linear's backward the ordinary one; attention, norms and elementwise steps recompute their
    # ordinary forward, no GEMM twice)
    exact_update: str = "recompute"

    def validate(self) -> None:
        _positive("quant", self, "uaq_scale")
        if self.exact_update not in EXACT_UPDATES:
            raise ConfigError(f"quant.exact_update={self.exact_update!r}: choose {' or '.join(EXACT_UPDATES)}")
        self._check_patterns()
        if self.mode is QuantMode.BF16:
            self.scheme = SCHEMES["bf16"]
        elif self.scheme is SCHEMES["bf16"]:
            raise ConfigError(f"quant.mode={self.mode} with quant.scheme=bf16 quantizes nothing: use "
                              "quant.mode=bf16, or pick a low-bit scheme")

    def _check_patterns(self) -> None:
        """Each include / exclude pattern names some linear layer of a quarl model (a typo would
        silently quantize nothing, or what was meant to stay dense), and low-bit modes keep one."""
        names = _linear_names(tuple(self.include) + tuple(self.exclude))
        for key, patterns in (("include", self.include), ("exclude", self.exclude)):
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                    raise ConfigError(
                        f"quant.{key} pattern {pattern!r} matches no linear layer: patterns are fnmatch globs over "
                        "module names, e.g. layers.* (every decoder linear, the default include), layers.0.*, "
                        "*.mlp.*, *.self_attn.q_proj, lm_head")
        kept = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.include)
                and not any(fnmatch.fnmatchcase(n, p) for p in self.exclude)]
        if self.mode is not QuantMode.BF16 and not kept:
            raise ConfigError(f"quant.include={self.include} minus quant.exclude={self.exclude} selects no linear "
                              f"layer: quant.mode={self.mode} would quantize nothing; narrow quant.exclude, or use "
                              "quant.mode=bf16")


@functools.lru_cache(maxsize=8)
def _linear_names(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """The module names ``quantize_model`` can swap in a quarl Transformer: its linear layers and an
    MoE layer's experts (``layers.L.mlp.experts``), those of a dense and of a sparse decoder layer
    read off meta-device models, repeated for layer indices 0-127 and any number a pattern names;
    lm_head."""
    import torch
    from torch import nn

    from quarl.model.moe import Experts
    from quarl.model.presets import preset_config
    from quarl.model.transformer import Transformer

    with torch.device("meta"):
        dense = Transformer(dataclasses.replace(preset_config("tiny"), num_hidden_layers=1))
        sparse = Transformer(dataclasses.replace(preset_config("moe-tiny"), num_hidden_layers=1, mlp_only_layers=()))
    inner: list[str] = []
    outer: list[str] = []
    for model in (dense, sparse):
        for n, m in model.named_modules():
            if not isinstance(m, (nn.Linear, Experts)):
                continue
            if n.startswith("layers.0."):
                inner.append(n.removeprefix("layers.0."))
            elif not n.startswith("layers."):
                outer.append(n)
    inner, outer = list(dict.fromkeys(inner)), list(dict.fromkeys(outer)) or ["lm_head"]
    indices = set(range(128)) | {int(d) for p in patterns for d in re.findall(r"\d+", p)}
    return tuple(f"layers.{i}.{n}" for i in sorted(indices) for n in inner) + tuple(outer)


@dataclass
class AlgoConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae"] = "grpo"
    loss: Literal["ppo", "positive_only", "sapo", "gspo", "tbpo"] = "tbpo"
    correction: str = "none"  # a preset (quarl.algos.corrections); tbpo's "none" is its own seq-tis
    # importance weights, rejection and veto as separate choices on top of the preset:
    weights: Literal["none", "token", "sequence", "geometric"] = "none"
    weight_low: float | None = None  # truncation bounds of the weights (None: 0 / cap, or the preset's)
    weight_high: float | None = None
    reject: Literal["none", "token", "sequence", "geometric"] = "none"
    reject_low: float | None = None  # kept band (None: 1 / reject_high, cap)
    reject_high: float | None = None
    veto: float | None = None  # a response with a token whose ratio leaves [veto, 1/veto] is removed
    eps_low: float | None = None  # None = the loss's own default
    eps_high: float | None = None
    delta_low: float | None = None
    delta_high: float | None = None
    dual_clip_c: float | None = None
    cap: float = 2.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    gamma: float = 1.0
    lam: float = 1.0
    value_coef: float = 0.5
    # error tokens (quarl.algos.errors): train on each response's prefix before its first
    # error token, a loop or a garbled stretch (errors/* metrics are logged either way)
    truncate_at_error: bool = False
    error_surprise: float = 8.0  # a token is bad when -learner_logp > this (nats) ...
    error_gap: float = 2.0  # ... and sampler_logp - learner_logp > this (nats)
    error_window: int = 8  # a garbled stretch: error_min_bad bad tokens within error_window
    error_min_bad: int = 3  # (1 = any single bad token)

    def _check_error_fields(self) -> None:
        for name in ("error_surprise", "error_gap"):
            value = getattr(self, name)
            if not value >= 0:  # (NaN too)
                raise ConfigError(f"algo.{name} must be >= 0 (nats), got {value}: set --algo.{name} to 0 or more")
        _at_least("algo", self, 1, "error_window")
        if not 1 <= self.error_min_bad <= self.error_window:
            raise ConfigError(
                f"algo.error_min_bad must be in [1, algo.error_window={self.error_window}], got {self.error_min_bad}: "
                f"set --algo.error_min_bad between 1 (any single bad token) and {self.error_window}, or raise "
                "--algo.error_window"
            )

    def _check_ranges(self) -> None:
        # the clip band [1 - eps_low, 1 + eps_high]: a lower distance of 1 or more (or any below 0)
        # is no band at all; delta_* bound TBPO's band for negative advantages the same way
        for name in ("eps_low", "delta_low"):
            _within("algo", self, name, 0, 1, open_high=True, meaning=" (the clip band's lower distance, 1 - x)")
        _at_least("algo", self, 0, "eps_high", "delta_high", "kl_coef", "value_coef")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise ConfigError(f"algo.dual_clip_c must be > 1 (a cap of c times the advantage on the loss of a "
                              f"negative-advantage token), got {self.dual_clip_c}: set --algo.dual_clip_c above 1 "
                              "(e.g. 3) or leave it unset")
        _positive("algo", self, "tau_pos", "tau_neg")
        for name in ("gamma", "lam"):
            _within("algo", self, name, 0, 1, meaning=" (GAE's discount / trace decay)")

    def correction_spec(self):
        """The :class:`~quarl.algos.corrections.CorrectionSpec` these fields describe (raises
        ``ValueError`` on a conflict; :meth:`validate` turns it into a ConfigError)."""
        from quarl.algos.corrections import build_spec

        own = self.correction == "none" and self.loss == "tbpo" and self.weights == "none"
        base = "seq-tis" if own else self.correction
        return build_spec(base, self.cap, weights=self.weights, weight_low=self.weight_low,
                          weight_high=self.weight_high, reject=self.reject, reject_low=self.reject_low,
                          reject_high=self.reject_high, veto=self.veto)

    def validate(self) -> None:
        self._check_ranges()
        self._check_error_fields()
        from quarl.algos.corrections import PRESETS, SEQ_CORRECTIONS, TOKEN_CORRECTIONS
        from quarl.algos.losses import ROW_WEIGHTS, SEQUENCE_LOSSES

        if self.correction not in PRESETS:
            raise ConfigError(f"unknown algo.correction {self.correction!r}{closest(self.correction, PRESETS)}; "
                              f"corrections: {', '.join(PRESETS)}")
        fits = SEQ_CORRECTIONS if self.loss in SEQUENCE_LOSSES else TOKEN_CORRECTIONS
        if self.loss == "sapo":
            fits = tuple(c for c in fits if c != "acr")
        if self.correction not in fits:
            raise ConfigError(f"algo.correction={self.correction} does not apply to algo.loss={self.loss}; "
                              f"it takes {', '.join(fits)}")
        try:
            spec = self.correction_spec()
        except ValueError as e:
            raise ConfigError(f"algo correction fields: {e} (fields algo.correction, algo.weights, "
                              "algo.weight_low/high, algo.reject, algo.reject_low/high, algo.veto)") from None
        if self.loss in SEQUENCE_LOSSES and spec.weights not in ROW_WEIGHTS:
            raise ConfigError(f"algo.loss={self.loss} weighs whole responses: set algo.weights to sequence or "
                              f"geometric, not {spec.weights}")


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 2e-4  # the demo's tiny model; real LLMs want ~1e-6 (AdamW) as in QaRL/QuRL
    muon_lr: float | None = None  # None = lr (Muon's update is RMS-matched to AdamW's)
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    # bf16/fp16 learners step FP32 master copies (4 bytes/param + its gradient); false: a bf16
    # model's weights are stepped directly, each write stochastically rounded (unbiased below one ulp)
    fp32_master: bool = True
    # dtype of AdamW's moments m and v (Muon's momentum stays in the stepped weights' dtype);
    # bfloat16 saves 4 bytes/param, with a float32 model too (its weights stay float32)
    state_dtype: Literal["float32", "bfloat16"] = "float32"

    def validate(self) -> None:
        _positive("optim", self, "lr", "muon_lr", "grad_clip")  # (a clip at 0 would zero every gradient)
        _at_least("optim", self, 0, "weight_decay", "warmup_steps")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1) (AdamW's beta1, beta2), got {self.betas}: "
                              "set e.g. --optim.betas=0.9,0.999")


@dataclass
class TrainerConfig:
    steps: int = 100
    prompts_per_step: int = 32
    ppo_epochs: int = 1
    mini_batches: int = 1
    token_budget: int = 8192  # micro-batch size in tokens (gradient accumulation)
    compile: bool = True  # CUDA: the learner runs each decoder layer as compiled regions (torch.compile)
    # the learner's forwards with gradients keep only each decoder layer's inputs and recompute
    # the layer in the backward: activations of L x 2 x [tokens, hidden] instead of every layer's
    activation_checkpointing: bool = False
    # under torchrun: each rank holds 1/world of every decoder layer's weights, gradients and
    # optimizer states (FSDP2, quarl.learner.sharded) instead of all of them; one process: no effect
    shard_learner: bool = False
    on_policy: bool = False
    dynamic_sampling: bool = False
    overlong_filter: bool = False
    sft_warmup_steps: int = 200
    sft_lr: float = 3e-3
    # > 0: the warm start ends at the first held-out check (every 10 steps) whose teacher-forced
    # exact share reaches this, at a constant rate; sft_warmup_steps is then the cap
    sft_target_exact: float = 0.0
    seed: int = 0
    device: str = "auto"
    run_dir: str = "runs/default"
    eval_every: int = 20
    eval_before_train: bool = False  # evaluate the step-0 policy first (logged as step 0)
    eval_teacher_forced: bool = True  # also score the eval split's worked solutions under the learner (eval/learner_*)
    save_every: int = 20
    keep_last: int = 2
    max_bad_steps: int = 5
    log_samples: int = 4
    tensorboard: bool = True
    wandb_project: str | None = None

    def validate(self) -> None:
        _at_least("trainer", self, 1, "steps", "prompts_per_step", "token_budget", "ppo_epochs", "mini_batches",
                  "keep_last", "max_bad_steps")
        _at_least("trainer", self, 0, "save_every", "eval_every")  # 0 = never
        _at_least("trainer", self, 0, "sft_warmup_steps", "log_samples")
        _positive("trainer", self, "sft_lr")
        if not 0 <= self.sft_target_exact <= 1:
            raise ConfigError(f"trainer.sft_target_exact is a share of the held-out solutions (0 = off), got "
                              f"{self.sft_target_exact}: set --trainer.sft_target_exact between 0 and 1")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:
        self._check_exact()
        if self.model.lora_rank:
            if self.quant.mode is QuantMode.ROLLOUT:
                raise ConfigError("model.lora_rank with quant.mode=rollout: a LoRA run's base is frozen in the "
                                  "rollout scheme and shared by engine and learner; use quant.mode=aligned "
                                  "(low-bit base) or quant.mode=bf16")
            if self.algo.advantage == "gae":
                raise ConfigError("model.lora_rank with algo.advantage=gae: the critic would be a full copy of "
                                  "the model; use algo.advantage=grpo, dr_grpo or rloo with LoRA")

    def _check_exact(self) -> None:
        """``quant.exact`` only where every op both forwards share runs its batch-invariant kernel:
        bf16 mode, or aligned mode with a weight-only int scheme (the invariant packed GEMM's) or
        W8A8 (per-token codes, then the invariant code GEMM), full or LoRA, on a dense model
        (bfloat16 or float32) or an MoE model (bfloat16; not w2a16, no expert adapters), with
        either KV cache, one learner per rank."""
        if not self.quant.exact:
            return
        exact_schemes = ("w4a16", "w4a16-asym", "w2a16", "w8a8-int8", "w8a8-fp8")
        why = []
        mode, scheme = self.quant.mode, self.quant.scheme.name
        if mode is QuantMode.ROLLOUT:
            why.append(f"quant.mode=rollout (quant.scheme={scheme}): the learner's full-precision weights are not "
                       "the engine's quantized ones, so their log-probs differ by design (aligned mode shares "
                       "the codes)")
        elif mode is QuantMode.ALIGNED and scheme not in exact_schemes:
            kind = ("no batch-invariant W4A8 GEMM exists yet" if self.quant.scheme.quantizes_activations
                    else "the fp4 formats have not been run in exact mode")
            why.append(f"quant.mode=aligned with quant.scheme={scheme}: {kind}")
        if mode is not QuantMode.BF16 and any(fnmatch.fnmatchcase("lm_head", p) for p in self.quant.include) \
                and not any(fnmatch.fnmatchcase("lm_head", p) for p in self.quant.exclude):
            why.append("quant.include selects lm_head: exact mode's LM head is dense")
        if self.model._is_moe():
            if self.model.dtype != "bfloat16":
                why.append(f"an MoE model in model.dtype={self.model.dtype}: the invariant grouped expert kernel "
                           "takes bfloat16 rows (set model.dtype=bfloat16)")
            if mode is QuantMode.ALIGNED and scheme == "w2a16":
                why.append("an MoE model with quant.scheme=w2a16: the grouped expert kernel reads int4 and 8-bit "
                           "experts only")
            if self.model.lora_rank and "experts" in self.model.lora_targets:
                why.append("model.lora_targets names experts: grouped expert adapters have no batch-invariant path")
        if self.model.dtype == "float16":
            why.append("model.dtype=float16: the invariant kernels are tested in bfloat16 and float32 only")
        if self.trainer.shard_learner:
            why.append("trainer.shard_learner=true: a sharded learner's linears have no exact path")
        if why:
            raise ConfigError("quant.exact=true is refused: " + "; ".join(why) + ". What works: quant.exact=true "
                              "with quant.mode=bf16, or quant.mode=aligned and quant.scheme "
                              f"{' / '.join(exact_schemes)}, full or LoRA, on a dense model in bfloat16 or float32 "
                              "(model.dtype) or an MoE model in bfloat16, "
                              "rollout.engine.kv_cache_dtype auto or fp8, trainer.shard_learner=false; or "
                              "quant.exact=false")


def load_run_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file (an older run's layout upgraded, :func:`upgrade`) <- CLI flags."""
    data = upgrade(read_yaml(path)) if path else {}
    return from_dict(RunConfig, merge(data, parse_overrides(overrides or [])))


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A run config written by an older quarl (a run's config.yaml, a checkpoint's config) in
    today's layout, so that its runs still resume, evaluate and export. Flags given by hand
    in the old layout still fail with the new key's name (``RolloutConfig._moved``)."""
    data = copy.deepcopy(data)
    rollout = data.get("rollout") or {}
    engine = rollout.setdefault("engine", {}) if isinstance(rollout, dict) else {}
    if "kv_cache_fraction" in rollout:
        engine.setdefault("gpu_memory_utilization", rollout.pop("kv_cache_fraction"))
    for key in ("block_size", "max_num_seqs", "cuda_graphs"):
        if key in rollout:
            engine.setdefault(key, rollout.pop(key))
    if rollout.get("num_kv_blocks", 512) != 512:  # 512 was the CPU default, never a cap on GPU
        engine.setdefault("num_kv_blocks", rollout["num_kv_blocks"])
    rollout.pop("num_kv_blocks", None)
    if "release_kv_cache" in rollout:
        if not rollout.pop("release_kv_cache"):
            rollout.setdefault("kv_cache_in_update", "keep")
    quant = data.get("quant") or {}
    if quant.get("mode") == "bf16":
        quant["scheme"] = "bf16"  # the scheme is resolved to bf16 in bf16 mode
    return data
