"""GPU runs of the QaRL loop on the ~100M built-in model; writes bench/results-style JSON.

Usage (repo root, GPU machine): PYTHONPATH=. python3 bench/train_gpu.py OUT_DIR [extra --section.key=value ...]
Runs the variants below on one warm-started model (same seed, same prompts) and records,
per step, the time breakdown (rollout / learner / publish / KV-cache re-creation),
rollout tok/s, reward and sampler-learner mismatch, plus medians over steps 2..N.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

from quarl.config import load_run_config
from quarl.trainer.loop import Trainer

DEFAULTS = [
    "--model.builtin=100m", "--data.task=arith", "--data.difficulty=2", "--data.num_train=4000",
    "--trainer.prompts_per_step=64", "--rollout.n=8", "--rollout.max_new_tokens=64", "--trainer.steps=12",
    "--trainer.sft_warmup_steps=150", "--trainer.sft_lr=1e-3", "--optim.lr=2e-6", "--trainer.eval_every=6",
    "--trainer.save_every=0", "--algo.loss=tbpo", "--trainer.token_budget=32768", "--quant.scheme=w4a16",
]
VARIANTS = {
    "aligned_w4a16": ["--quant.mode=aligned"],
    "aligned_w4a16_keep_kv": ["--quant.mode=aligned", "--rollout.release_kv_cache=false"],
    "rollout_w4a16": ["--quant.mode=rollout"],
    "bf16": ["--quant.mode=bf16"],
}
KEYS = ("time/rollout", "time/learner", "time/publish", "time/kv_cache", "time/step", "rollout/tokens_per_s",
        "reward/mean", "acc/mean", "mismatch/kl_k3", "mismatch/abs_logp_diff_mean", "response/len_mean",
        "tbpo/drop_frac_pos", "tbpo/drop_frac_neg", "quant/update_visible_frac", "memory/rollout_peak_gb",
        "memory/learner_peak_gb", "eval/acc", "grad_norm")


def run_variant(name: str, overrides: list[str], base: Path, warm: Path | None) -> tuple[dict, Path]:
    run_dir = base / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if warm is not None:
        shutil.copytree(warm, run_dir / "warmstart")
    cfg = load_run_config(None, overrides + [f"--trainer.run_dir={run_dir}"])
    console = None
    if os.environ.get("QUARL_VERBOSE"):
        from rich.console import Console

        console = Console(stderr=True, force_terminal=False)
    trainer = Trainer(cfg, console=console)
    trainer.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] if len(rows) > 1 else rows
    result = {
        "overrides": overrides,
        "median_steps_2_to_n": {k: statistics.median(r[k] for r in steady if r.get(k) is not None)
                                for k in KEYS if any(r.get(k) is not None for r in steady)},
        "steps": [{k: r.get(k) for k in ("step",) + KEYS if k in r} for r in rows],
    }
    print(name, json.dumps(result["median_steps_2_to_n"]), flush=True)
    return result, run_dir / "warmstart"


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    extra = sys.argv[2:]
    only = os.environ.get("QUARL_VARIANTS")
    base = Path(os.environ.get("QUARL_RUN_DIR", "/tmp/quarl_train_gpu"))  # checkpoints stay off $OUT
    results, warm = {}, None
    for name, variant in VARIANTS.items():
        if only and name not in only.split(","):
            continue
        results[name], warm = run_variant(name, DEFAULTS + variant + extra, base, warm)
    report = {
        "benchmark": "train_step",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("QUARL_GIT_COMMIT", "unknown"),
        "variants": results,
    }
    (out / "train_gpu.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
