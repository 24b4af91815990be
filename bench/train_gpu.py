"""GPU run of the QaRL loop on the ~100M built-in model; writes bench/results-style JSON.

Usage (repo root, GPU machine): PYTHONPATH=. python3 bench/train_gpu.py OUT_DIR [extra --section.key=value ...]
Records per-step time breakdown (rollout / learner / publish), rollout tok/s, reward and
mismatch for aligned W4A16 + TBPO (defaults below), plus the medians over steps 2..N.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from quarl.config import load_run_config
from quarl.trainer.loop import Trainer

DEFAULTS = [
    "--model.builtin=100m", "--data.task=arith", "--data.difficulty=2", "--trainer.prompts_per_step=64",
    "--rollout.n=8", "--rollout.max_new_tokens=64", "--trainer.steps=12", "--trainer.sft_warmup_steps=300",
    "--trainer.sft_lr=1e-3", "--optim.lr=2e-6", "--trainer.eval_every=6", "--trainer.save_every=0",
    "--quant.mode=aligned", "--quant.scheme=w4a16", "--algo.loss=tbpo", "--trainer.token_budget=32768",
]
KEYS = ("time/rollout", "time/learner", "time/publish", "time/kv_cache", "time/step", "rollout/tokens_per_s", "reward/mean",
        "acc/mean", "mismatch/kl_k3", "mismatch/abs_logp_diff_mean", "response/len_mean", "tbpo/drop_frac_pos",
        "tbpo/drop_frac_neg", "quant/update_visible_frac", "memory/learner_peak_gb", "eval/acc", "grad_norm")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    extra = sys.argv[2:]
    run_dir = Path(os.environ.get("QUARL_RUN_DIR", "/tmp/quarl_train_gpu"))  # checkpoints stay off $OUT
    cfg = load_run_config(None, DEFAULTS + extra + [f"--trainer.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    trainer.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (out / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    steady = rows[1:] if len(rows) > 1 else rows
    result = {
        "benchmark": "train_step",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("QUARL_GIT_COMMIT", "unknown"),
        "model_params_m": round(trainer.learner.model.config.num_parameters() / 1e6, 1),
        "overrides": DEFAULTS + extra,
        "median_steps_2_to_n": {k: statistics.median(r[k] for r in steady if r.get(k) is not None)
                                for k in KEYS if any(r.get(k) is not None for r in steady)},
        "steps": [{k: r.get(k) for k in ("step",) + KEYS if k in r} for r in rows],
    }
    (out / "train_gpu.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["median_steps_2_to_n"], indent=2))


if __name__ == "__main__":
    main()
