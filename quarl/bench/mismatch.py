"""Where the sampler/learner mismatch comes from: the engine against the learner, and the
learner against itself.

For each mode, one rollout of a ``quarl bench train`` workload (the same random-weight
model, prompts and sampling) is scored by the learner at two token budgets. The budgets
cut the batch into micro-batches of other shapes, so the GEMM libraries run other
kernels that sum in other orders; nothing else changes. Three KLs (``k3``, token mean,
the trainer's ``mismatch/kl_k3``) come out per mode:

- ``engine_vs_learner``: what training sees, at the workload's budget;
- ``learner_vs_learner``: the learner at the workload's budget against itself at the
  other one, the part of the mismatch that summation order alone makes;
- ``engine_vs_learner_other``: the engine against the learner at the other budget;
- ``nudged_vs_learner``: the learner against itself with the input of every decoder
  linear moved by one unit in the last place on a random fraction ``nudge`` of its
  elements (16-bit models), a controlled stand-in for the last-bit differences that
  another summation order leaves. Its ratio to bf16's is how much a mode's arithmetic
  amplifies such differences (an activation quantizer turns a last-bit change into a
  whole code step whenever it crosses a rounding boundary).

Read together: when the learner agrees with itself across budgets, the engine/learner
gap comes from the engine's kernels summing in another order than the learner's; a
mode's gap is explained by that order noise when its ``engine_vs_learner`` relative to
bf16's is about its ``nudged_vs_learner`` relative to bf16's.
"""

from __future__ import annotations

import datetime
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from quarl.algos import mismatch_metrics


def _kl_k3(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    m = mismatch_metrics(a, b, mask)
    differ = ((a != b) & (mask > 0)).sum() / mask.sum().clamp(min=1)
    return {"kl_k3": m["mismatch/kl_k3"], "abs_logp_diff_mean": m["mismatch/abs_logp_diff_mean"],
            "abs_logp_diff_max": m["mismatch/max_abs_logp_diff"], "tokens_differ": float(differ)}


def nudge_inputs(model: torch.nn.Module, frac: float, seed: int = 0) -> list:
    """Forward pre-hooks on every linear of ``model.layers`` that move a random fraction
    ``frac`` of each 16-bit input's nonzero elements one unit in the last place away from
    zero; returns the hook handles (``.remove()`` them)."""
    gen: dict[torch.device, torch.Generator] = {}

    def hook(module, args):
        x = args[0]
        if x.dtype not in (torch.bfloat16, torch.float16):
            return None
        g = gen.setdefault(x.device, torch.Generator(device=x.device).manual_seed(seed))
        pick = (torch.rand(x.shape, device=x.device, generator=g) < frac) & (x != 0) & x.isfinite()
        bits = x.view(torch.int16)  # sign-magnitude: +1 is one ulp up in magnitude either sign
        return (torch.where(pick, bits + 1, bits).view(x.dtype), *args[1:])

    from quarl.quant.linear import QATLinear

    return [m.register_forward_pre_hook(hook) for m in model.layers.modules()
            if isinstance(m, (torch.nn.Linear, QATLinear))]


def measure_mode(overrides: list[str], run_dir: Path, other_budget: int, nudge: float = 0.1) -> dict[str, Any]:
    """One rollout of the run ``overrides`` describe, its log-probs under the learner at the
    run's token budget, at ``other_budget``, and with its linears' inputs nudged, and the
    KLs between them."""
    from quarl.config import load_run_config
    from quarl.trainer.loop import Trainer
    from quarl.trainer.scoring import batch_with_advantages
    from quarl.trainer.stages import StageClock

    cfg = load_run_config(None, overrides + [f"--trainer.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    try:
        rollout, _ = trainer.collector.collect(trainer.step, StageClock(trainer.device))
        batch = batch_with_advantages(rollout, cfg.algo, cfg.rollout.n, cfg.trainer.overlong_filter).to(trainer.device)
        budget, temp = cfg.trainer.token_budget, cfg.rollout.temperature
        learner = trainer.learner.logprobs(batch, budget, temp)
        other = trainer.learner.logprobs(batch, other_budget, temp)
        hooks = nudge_inputs(trainer.learner.model, nudge)
        try:
            nudged = trainer.learner.logprobs(batch, budget, temp)
        finally:
            for h in hooks:
                h.remove()
        mask, engine = batch.response_mask, batch.sampler_logp
        return {
            "tokens": int(mask.sum()), "budgets": [budget, other_budget], "nudge": nudge,
            "engine_vs_learner": _kl_k3(learner, engine, mask),
            "learner_vs_learner": _kl_k3(other, learner, mask),
            "engine_vs_learner_other": _kl_k3(other, engine, mask),
            "nudged_vs_learner": _kl_k3(nudged, learner, mask),
        }
    finally:
        trainer.rewards.close()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_mismatch(workload: str, modes: list[str], other_budget: int, extra: list[str],
                 out: Path | None, nudge: float = 0.1) -> dict[str, Any]:
    from quarl.bench.common import git_commit, write_json
    from quarl.bench.train import MODES, check_workload, save_random_model, workload_overrides

    w = check_workload(workload, modes)
    if other_budget == w.token_budget:
        raise ValueError(f"--other-budget must differ from the workload's token budget ({w.token_budget})")
    cuda = torch.cuda.is_available()
    result: dict[str, Any] = {
        "benchmark": "mismatch_sources", "workload": workload, "workload_spec": w.__dict__ | {"extra": list(w.extra)},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "torch": torch.__version__, "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="quarl_bench_mismatch_") as tmp:
        model_dir = save_random_model(w.shape, Path(tmp) / "model")
        for mode in modes:
            overrides = workload_overrides(w, model_dir) + MODES[mode] + ["--trainer.steps=1"] + extra
            r = measure_mode(overrides, Path(tmp) / mode, other_budget, nudge)
            result["modes"][mode] = r
            print(mode, json.dumps(r), flush=True)
    write_json(result, out)
    return result


def summary_table(result: dict[str, Any]) -> str:
    lines = [f"{result['workload']} on {result['device']} at {result['git_commit'][:7]}: kl_k3 (token mean) and the "
             "share of tokens whose log-probs differ at all",
             "| mode | engine vs learner | learner vs learner (other budget) | engine vs learner (other budget) | "
             "learner nudged vs learner | engine gap / bf16's | nudge gap / bf16's |",
             "|---|---|---|---|---|---|---|"]
    keys = ("engine_vs_learner", "learner_vs_learner", "engine_vs_learner_other", "nudged_vs_learner")
    base = result["modes"].get("bf16")
    for mode, r in result["modes"].items():
        cells = [f"{r[k]['kl_k3']:.2e} ({r[k]['tokens_differ']:.0%})" for k in keys]
        for k in ("engine_vs_learner", "nudged_vs_learner"):
            cells.append(f"{r[k]['kl_k3'] / base[k]['kl_k3']:.1f}x" if base and base[k]["kl_k3"] > 0 else "-")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
