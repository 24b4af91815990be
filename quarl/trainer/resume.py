"""What ``--resume`` checks before it touches a run directory.

A run directory holds one run. Before anything is built or written, the trainer asks:

* :func:`existing_run` -- does the directory already hold a run (metrics, samples or
  checkpoints)? A new run into it is refused; the warm-start cache (``warmstart/``)
  alone is not a run, it is only reused.
* :func:`check_config_change` -- does the resumed config differ from the run's own?

Settings fall in two groups. Those in :data:`FIXED` decide what the checkpoint's
state *is* or what the data position *means*; changing them mid-run either cannot
load (another model, quantization layout or optimizer) or silently makes a different
run out of the same step counter, so they are refused unless the user passes
``--allow-config-change``:

* ``model.*``                           -- the network and its tokenizer
* ``data.*`` except ``reward_workers`` and ``reward_timeout_s`` (how fast rewards are
  computed, not what they are) -- the examples, their order and the verifier
* ``quant.mode``, ``quant.scheme``, ``quant.uaq_scale``, ``quant.include``,
  ``quant.exclude``                     -- the learner's weight layout and values
* ``optim.name``, ``optim.fp32_master``, ``optim.state_dtype`` -- the optimizer state's layout
* ``trainer.seed``, ``trainer.prompts_per_step``, ``rollout.n`` -- the per-step
  randomness and how far a step moves the data position
* ``trainer.sft_warmup_steps``, ``trainer.sft_lr``, ``trainer.sft_target_exact`` -- the step-0
  policy (the KL reference)
* ``algo.advantage`` when it adds or removes the critic (``gae``)

Everything else (``trainer.steps``, ``eval_every``, ``save_every``, ``keep_last``,
``trainer.activation_checkpointing`` (the same values, recomputed), logging, learning
rate, loss hyper-parameters, ...) may change on resume; each change is named in a
one-line notice. Most are read afresh at every step. The optimizer's settings
(:data:`OPTIMIZER_SETTINGS`) are also stored in the checkpoint's optimizer and scheduler
state, which loading would bring back: :func:`apply_optimizer_settings` puts the
config's values in place after the load, so they apply from the first resumed step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quarl.trainer import checkpoint as ckpt

FIXED_SECTIONS = ("model.", "data.")
FIXED_EXCEPT = ("data.reward_workers", "data.reward_timeout_s")
FIXED = (
    "quant.mode", "quant.scheme", "quant.uaq_scale", "quant.include", "quant.exclude",
    "optim.name", "optim.fp32_master", "optim.state_dtype", "trainer.seed", "trainer.prompts_per_step", "rollout.n",
    "trainer.sft_warmup_steps", "trainer.sft_lr", "trainer.sft_target_exact",
)
IGNORED = ("trainer.run_dir",)  # the directory may have been moved; it is where we resume from
RUN_FILES = ("metrics.jsonl", "samples.jsonl")
OPTIMIZER_SETTINGS = ("optim.lr", "optim.muon_lr", "optim.warmup_steps", "optim.weight_decay", "optim.betas")


def check_resumable(run_dir: Path) -> None:
    """ValueError unless ``run_dir`` holds a run to continue (a checkpoint, metrics or its
    config.yaml): a mistyped path must not start a new run from step 0."""
    if not run_dir.is_dir():
        raise ValueError(f"--resume: {run_dir} does not exist, so there is no run to continue: check the path "
                         "(--trainer.run_dir), or drop --resume to start a new run there")
    if existing_run(run_dir) is None and not (run_dir / "config.yaml").is_file():
        raise ValueError(f"--resume: {run_dir} holds no run (no checkpoint, metrics.jsonl or config.yaml): check "
                         "the path (--trainer.run_dir), or drop --resume to start a new run there")


def apply_optimizer_settings(learner: Any, optim: Any) -> None:
    """Set the optimizer's hyper-parameters and the scheduler's base rates from ``optim`` (an
    ``OptimConfig``) after a checkpoint's state was loaded into ``learner``: the current
    learning rate becomes the new base rate times the warm-up factor of the optimizer steps
    taken so far (the warm-up's length is the config's: the scheduler's factor is a function
    of this run's settings, not stored)."""
    parts = getattr(learner.optimizer, "optimizers", [learner.optimizer])  # (Muon + AdamW: one each)
    bases: list[float] = []
    for part in parts:
        muon = "betas" not in part.defaults  # (Muon's groups have a momentum instead)
        lr = (optim.muon_lr or optim.lr) if muon else optim.lr
        for group in part.param_groups:
            _set_group(group, lr, optim)
            bases.append(lr)
    scheduler = learner.scheduler
    scheduler.base_lrs = bases
    for group, base, factor in zip(learner.optimizer.param_groups, bases, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in learner.optimizer.param_groups]
    if learner.critic_optimizer is not None:  # (unscheduled: the critic steps at optim.lr)
        for group in learner.critic_optimizer.param_groups:
            _set_group(group, optim.lr, optim)
            group["lr"] = optim.lr


def _set_group(group: dict, lr: float, optim: Any) -> None:
    group["initial_lr"] = lr
    group["weight_decay"] = optim.weight_decay
    if "betas" in group:
        group["betas"] = tuple(optim.betas)


def existing_run(run_dir: Path) -> str | None:
    """What makes ``run_dir`` an existing run, in words (None: nothing, a new run may start)."""
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None:
        return f"checkpoint {latest.name}"
    found = [name for name in RUN_FILES if (run_dir / name).is_file()]
    root = ckpt.checkpoint_dir(run_dir)
    if root.is_dir() and any(root.iterdir()):
        found.append("checkpoints/ (none complete)")
    if found:
        return f"{', '.join(found)}; no checkpoint was written"
    return None


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for each setting that differs; keys the old run did not have are skipped."""
    a, b = flatten(old), flatten(new)
    return [(k, a[k], b[k]) for k in sorted(b) if k in a and k not in IGNORED and _norm(a[k]) != _norm(b[k])]


def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def is_fixed(key: str, old: Any, new: Any) -> bool:
    if key == "algo.advantage":
        return (old == "gae") != (new == "gae")
    if key in FIXED_EXCEPT:
        return False
    return key in FIXED or key.startswith(FIXED_SECTIONS)


def check_config_change(old: dict[str, Any], new: dict[str, Any], source: str, allow: bool,
                        run_dir: str | Path = "DIR") -> list[str]:
    """One notice per changed setting; ValueError when a :data:`FIXED` one changed and ``allow`` is False."""
    changes = config_changes(old, new)
    fixed = [(k, a, b) for k, a, b in changes if is_fixed(k, a, b)]
    if fixed and not allow:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in fixed)
        raise ValueError(
            f"--resume would change settings that the run's checkpoint depends on ({listed}; "
            f"the run's are in {source}). Rerun with the original flags (or with none: "
            f"'quarl train --resume --trainer.run_dir={run_dir}' uses the run's config.yaml), "
            f"or pass --allow-config-change to continue with the new values"
        )
    return [f"resume: {k} changed {a!r} -> {b!r}" + _applied(k, (k, a, b) in fixed) for k, a, b in changes]


def _applied(key: str, fixed: bool) -> str:
    if fixed:
        return " (allowed by --allow-config-change)"
    return " (applied from the first resumed step)" if key in OPTIMIZER_SETTINGS else ""
