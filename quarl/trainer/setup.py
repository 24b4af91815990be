"""Building what a run needs from its config: device, task, rewards, the base model."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from quarl.runtime import resolve_device, resolve_dtype
from quarl.config import DataConfig, RunConfig
from quarl.config.run import TrainerConfig
from quarl.model.config import TransformerConfig
from quarl.model.presets import DEMO_PRESETS, blank_model, build_random_model, preset_config
from quarl.model.transformer import Transformer
from quarl.quant.mode import QuantMode


def resolve_runtime(cfg: RunConfig) -> tuple[torch.device, torch.dtype]:
    device = resolve_device(cfg.trainer.device, flag="--trainer.device")
    return device, resolve_dtype(cfg.model.dtype, device)


def build_task_and_rewards(data: DataConfig):
    """The task and a reward pool scoring completions with the configured verifier."""
    from quarl.tasks import RewardPool, build_task

    task = build_task(data)
    pool = RewardPool(task.reward_spec, workers=data.reward_workers, timeout_s=data.reward_timeout_s)
    return task, pool


def build_base_model(
    cfg: RunConfig,
    tokenizer,
    task,
    device: torch.device,
    dtype: torch.dtype,
    run_dir: Path,
    say: Callable[[str], None],
    console=None,
    resuming: bool = False,
) -> Transformer:
    """The policy at step 0: a local checkpoint, or the built-in model after its warm-start.

    console: where the warm-start's progress goes (a rich Console; None: nowhere).
    resuming: a checkpoint is about to be loaded. Where it holds every weight of the policy
    (a full fine-tune) and nothing else reads the base (no KL reference, warm-start or UAQ),
    a built-in model is only shaped, not drawn (a 14B model's random numbers took a minute
    of each resume).
    """
    m = cfg.model
    arch = TransformerConfig.from_dir(m.path) if m.path else preset_config(m.builtin)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {arch.vocab_size}; "
            + ("pass the model's own tokenizer with --model.tokenizer=DIR" if m.path else
               "the built-in models use the built-in tokenizer: drop --model.tokenizer (or set it to builtin)")
        )
    if quantized_on_loading(cfg):
        return quantized_base(cfg, arch, device, dtype, say)
    if cfg.trainer.sft_warmup_steps > 0:
        # the warm-start steps float32 weights (bf16 autocast on CUDA); the base model is only
        # built when the cache misses
        model = warm_start(cfg, tokenizer, task, device, dtype, run_dir / "warmstart", say, console,
                           make_model=lambda: fresh_model(cfg, arch, device, torch.float32, resuming))
    else:
        model = fresh_model(cfg, arch, device, dtype, resuming)
    model = model.to(dtype=dtype)
    if cfg.quant.uaq_scale != 1.0:
        from quarl.quant import apply_uaq

        apply_uaq(model, cfg.quant.uaq_scale)
    return model


def quantized_on_loading(cfg: RunConfig) -> bool:
    """Whether the base is quantized on its way to the device, one linear at a time: a LoRA
    base in aligned mode never trains (nor is it warm-started or scaled for UAQ)."""
    m, t = cfg.model, cfg.trainer
    return bool(m.lora_rank and cfg.quant.mode is QuantMode.ALIGNED and cfg.quant.uaq_scale == 1.0
                and t.sft_warmup_steps == 0 and (m.path or m.builtin not in DEMO_PRESETS))


def quantized_base(cfg: RunConfig, arch: TransformerConfig, device: torch.device, dtype: torch.dtype,
                   say: Callable[[str], None]) -> Transformer:
    """:func:`quantized_on_loading`'s base: ``model.path`` quantized while loading (or from its
    packed cache), or a released model's shape on random weights (benchmarks)."""
    from quarl.model.quantized_loading import load_quantized_model, random_quantized_model

    m, q = cfg.model, cfg.quant
    if not m.path:
        say(f"base: random {m.builtin} weights in {q.scheme.name}, made one linear at a time")
        return random_quantized_model(arch, q.scheme, seed=cfg.trainer.seed, dtype=dtype, device=device,
                                      include=q.include, exclude=q.exclude)
    model = load_quantized_model(m.path, q.scheme, dtype=dtype, device=device, include=q.include,
                                 exclude=q.exclude, cache_dir=m.packed_cache)
    say(f"base {m.path} in {q.scheme.name}" + (" (from the packed cache)" if model.quantized_from_cache
                                               else ", quantized while loading"))
    return model


def fresh_model(cfg: RunConfig, arch: TransformerConfig, device: torch.device, dtype: torch.dtype,
                resuming: bool) -> Transformer:
    """``model.path`` loaded, else the built-in model on random weights (only shaped where a
    full fine-tune's checkpoint is about to overwrite every weight: see :func:`build_base_model`)."""
    import quarl

    m, t = cfg.model, cfg.trainer
    if m.path:
        return quarl.load_model(m.path, dtype=dtype, device=device)
    if resuming and not m.lora_rank and cfg.algo.kl_coef == 0 and cfg.quant.uaq_scale == 1.0 \
            and t.sft_warmup_steps == 0:  # (a warm-start trains, and caches, what this builds)
        return blank_model(arch, dtype=dtype, device=device)
    return build_random_model(arch, seed=t.seed, dtype=dtype, device=device)


def warm_start(cfg: RunConfig, tokenizer, task, device: torch.device, dtype: torch.dtype, cache_dir: Path,
               say: Callable[[str], None], console, make_model: Callable[[], Transformer]) -> Transformer:
    """``make_model()``'s model after ``trainer.sft_warmup_steps`` supervised steps on the train
    split's worked solutions, cached in ``cache_dir`` under a key of what decides its weights
    (a hit loads it instead: ``make_model`` is then not called)."""
    from quarl.trainer.warmstart import cached_warmstart, sft_pairs

    t = cfg.trainer
    pairs = sft_pairs(task, tokenizer, task.train_examples())
    key = warmstart_key(cfg, getattr(tokenizer, "name", "?"), device)
    heldout = solution_pairs(task, tokenizer)[:256]  # (teacher-forced: one forward a check)
    if t.sft_target_exact > 0 and not heldout:
        raise ValueError(f"trainer.sft_target_exact={t.sft_target_exact} needs worked solutions in the eval split; "
                         f"task {cfg.data.task!r} has none: set trainer.sft_target_exact=0")
    curve: list[dict] = []  # the held-out checks, kept beside the cached weights

    def train(model: Transformer) -> list[float]:
        return supervised_warm_start(model, pairs, heldout, t, say, console, curve)

    model, cached = cached_warmstart(cache_dir, key, make_model, train, dtype, device, extra=lambda: {"heldout": curve})
    if cached:
        say(f"supervised warm-start: loaded from {cache_dir}")
    return model


def warmstart_key(cfg: RunConfig, tokenizer_name: str, device: torch.device) -> dict:
    """What decides a warm start's weights: its cache key."""
    m, t = cfg.model, cfg.trainer
    key = {
        "model": m.path or m.builtin, "task": cfg.data.task, "difficulty": cfg.data.difficulty,
        "data_seed": cfg.data.seed, "steps": t.sft_warmup_steps, "lr": t.sft_lr, "seed": t.seed,
        "tokenizer": tokenizer_name, "amp": "bf16" if device.type == "cuda" else "none",
        "schedule": "wsd", "deterministic": True,
    }
    if t.sft_target_exact > 0:  # (the key of a fixed-length warm start stays what it was)
        key.update(schedule="constant", target_exact=t.sft_target_exact)
    return key


def supervised_warm_start(model: Transformer, pairs: list, heldout: list, t: TrainerConfig,
                          say: Callable[[str], None], console, curve: list[dict]) -> list[float]:
    """The warm start's steps on ``model`` (:func:`~quarl.trainer.warmstart.supervised_finetune`),
    with a progress bar, checked on ``heldout`` (each check appended to ``curve``); stops early
    once ``trainer.sft_target_exact`` of them are exact. Returns the losses."""
    from quarl.trainer.progress import StepProgress, describe_loss
    from quarl.trainer.warmstart import supervised_finetune

    steps, target = t.sft_warmup_steps, t.sft_target_exact
    every = 10 if target > 0 else max(50, steps // 10)
    until = f" (or until {target:.0%} of held-out solutions are exact)" if target > 0 else ""
    say(f"supervised warm-start: {steps} steps{until} on {len(pairs)} worked solutions")

    def on_eval(step: int, m: dict) -> None:
        curve.append({"step": step, **m})
        if step % 50 == 0 or step == steps or (target > 0 and m["exact"] >= target):
            say(f"supervised warm-start: step {step}, held-out exact {m['exact']:.3f}, loss {m['loss']:.4f}")

    with StepProgress(steps, 0, console, label="warm-start", describe=describe_loss) as bar:
        losses = supervised_finetune(model, pairs, steps, t.sft_lr, seed=t.seed,
                                     on_step=lambda i, loss: bar.update(i + 1, {"loss": loss}),
                                     heldout=heldout, eval_every=every, on_eval=on_eval, target_exact=target)
    if target > 0 and curve[-1]["exact"] < target:
        say(f"supervised warm-start: held-out exact {curve[-1]['exact']:.3f} after the cap of "
            f"{steps} steps, short of the target {target}: raise trainer.sft_warmup_steps")
    say(f"supervised warm-start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def solution_pairs(task, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The eval split's worked solutions as (prompt, target) pairs; none where it has none."""
    from quarl.trainer.warmstart import sft_pairs

    try:
        return sft_pairs(task, tokenizer, task.eval_examples())
    except ValueError:
        return []
