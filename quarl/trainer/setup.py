"""Building what a run needs from its config: device, task, rewards, the base model."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from quarl.runtime import resolve_device, resolve_dtype
from quarl.config import DataConfig, RunConfig
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
    import quarl
    from quarl.trainer.progress import StepProgress, describe_loss
    from quarl.trainer.warmstart import cached_warmstart, sft_pairs, supervised_finetune

    m, t = cfg.model, cfg.trainer
    arch = TransformerConfig.from_dir(m.path) if m.path else preset_config(m.builtin)
    if tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {arch.vocab_size}; "
            + ("pass the model's own tokenizer with --model.tokenizer=DIR" if m.path else
               "the built-in models use the built-in tokenizer: drop --model.tokenizer (or set it to builtin)")
        )

    if m.lora_rank and cfg.quant.mode is QuantMode.ALIGNED and cfg.quant.uaq_scale == 1.0 \
            and t.sft_warmup_steps == 0 and (m.path or m.builtin not in DEMO_PRESETS):
        # a LoRA base never trains: quantize it on the way to the device, one linear at a time
        from quarl.model.quantized_loading import load_quantized_model, random_quantized_model

        q = cfg.quant
        if not m.path:  # a released model's shape on random weights (benchmarks)
            say(f"base: random {m.builtin} weights in {q.scheme.name}, made one linear at a time")
            return random_quantized_model(arch, q.scheme, seed=t.seed, dtype=dtype, device=device,
                                          include=q.include, exclude=q.exclude)
        model = load_quantized_model(m.path, q.scheme, dtype=dtype, device=device, include=q.include,
                                     exclude=q.exclude, cache_dir=m.packed_cache)
        say(f"base {m.path} in {q.scheme.name}" + (" (from the packed cache)" if model.quantized_from_cache
                                                   else ", quantized while loading"))
        return model

    def build(build_dtype: torch.dtype) -> Transformer:
        if m.path:
            return quarl.load_model(m.path, dtype=build_dtype, device=device)
        if resuming and not m.lora_rank and cfg.algo.kl_coef == 0 and cfg.quant.uaq_scale == 1.0 \
                and t.sft_warmup_steps == 0:  # (a warm-start trains, and caches, what this builds)
            return blank_model(arch, dtype=build_dtype, device=device)
        return build_random_model(arch, seed=t.seed, dtype=build_dtype, device=device)

    if t.sft_warmup_steps > 0:
        pairs = sft_pairs(task, tokenizer, task.train_examples())
        key = {
            "model": m.path or m.builtin, "task": cfg.data.task, "difficulty": cfg.data.difficulty,
            "data_seed": cfg.data.seed, "steps": t.sft_warmup_steps, "lr": t.sft_lr, "seed": t.seed,
            "tokenizer": getattr(tokenizer, "name", "?"), "amp": "bf16" if device.type == "cuda" else "none",
            "schedule": "wsd", "deterministic": True,
        }
        if t.sft_target_exact > 0:  # (the key of a fixed-length warm start stays what it was)
            key.update(schedule="constant", target_exact=t.sft_target_exact)
        heldout = solution_pairs(task, tokenizer)[:256]  # (teacher-forced: one forward a check)
        curve: list[dict] = []

        target = t.sft_target_exact
        if target > 0 and not heldout:
            raise ValueError(f"trainer.sft_target_exact={target} needs worked solutions in the eval split; "
                             f"task {cfg.data.task!r} has none: set trainer.sft_target_exact=0")
        every = 10 if target > 0 else max(50, t.sft_warmup_steps // 10)

        def train(mdl: Transformer) -> list[float]:
            until = f" (or until {target:.0%} of held-out solutions are exact)" if target > 0 else ""
            say(f"supervised warm-start: {t.sft_warmup_steps} steps{until} on {len(pairs)} worked solutions")

            def on_eval(step: int, m: dict) -> None:
                curve.append({"step": step, **m})
                if step % 50 == 0 or step == t.sft_warmup_steps or (target > 0 and m["exact"] >= target):
                    say(f"supervised warm-start: step {step}, held-out exact {m['exact']:.3f}, loss {m['loss']:.4f}")

            with StepProgress(t.sft_warmup_steps, 0, console, label="warm-start", describe=describe_loss) as bar:
                losses = supervised_finetune(mdl, pairs, t.sft_warmup_steps, t.sft_lr, seed=t.seed,
                                             on_step=lambda i, loss: bar.update(i + 1, {"loss": loss}),
                                             heldout=heldout, eval_every=every, on_eval=on_eval, target_exact=target)
            if target > 0 and curve[-1]["exact"] < target:
                say(f"supervised warm-start: held-out exact {curve[-1]['exact']:.3f} after the cap of "
                    f"{t.sft_warmup_steps} steps, short of the target {target}: raise trainer.sft_warmup_steps")
            say(f"supervised warm-start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            return losses

        # the warm-start steps float32 weights (bf16 autocast on CUDA); the base model is only
        # built when the cache misses
        model, cached = cached_warmstart(run_dir / "warmstart", key, lambda: build(torch.float32), train, dtype,
                                         device, extra=lambda: {"heldout": curve})
        if cached:
            say(f"supervised warm-start: loaded from {run_dir / 'warmstart'}")
    else:
        model = build(dtype)
    model = model.to(dtype=dtype)
    if cfg.quant.uaq_scale != 1.0:
        from quarl.quant import apply_uaq

        apply_uaq(model, cfg.quant.uaq_scale)
    return model


def solution_pairs(task, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The eval split's worked solutions as (prompt, target) pairs; none where it has none."""
    from quarl.trainer.warmstart import sft_pairs

    try:
        return sft_pairs(task, tokenizer, task.eval_examples())
    except ValueError:
        return []
