"""Values out of range fail at load time with the key, the value and what to set instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quarl.config import load_run_config
from quarl.config.typed import ConfigError

BAD = [
    ("--trainer.steps=0", r"trainer.steps must be >= 1, got 0"),
    ("--trainer.steps=-3", r"trainer.steps must be >= 1, got -3"),
    ("--trainer.prompts_per_step=0", r"trainer.prompts_per_step must be >= 1"),
    ("--trainer.token_budget=0", r"trainer.token_budget must be >= 1"),
    ("--trainer.ppo_epochs=0", r"trainer.ppo_epochs must be >= 1"),
    ("--trainer.mini_batches=0", r"trainer.mini_batches must be >= 1"),
    ("--trainer.save_every=-1", r"trainer.save_every must be >= 0"),
    ("--trainer.eval_every=-1", r"trainer.eval_every must be >= 0"),
    ("--trainer.keep_last=0", r"trainer.keep_last must be >= 1"),
    ("--trainer.max_bad_steps=0", r"trainer.max_bad_steps must be >= 1"),
    ("--rollout.max_new_tokens=0", r"rollout.max_new_tokens must be >= 1"),
    ("--rollout.temperature=-0.5", r"rollout.temperature must be >= 0"),
    ("--rollout.top_p=0", r"rollout.top_p must be in \(0, 1\], got 0.0"),
    ("--rollout.top_p=1.5", r"rollout.top_p must be in \(0, 1\]"),
    ("--data.num_train=0", r"data.num_train must be >= 1"),
    ("--data.reward_workers=-1", r"data.reward_workers must be >= 0"),
    ("--data.reward_timeout_s=0", r"data.reward_timeout_s must be > 0"),
    ("--optim.lr=0", r"optim.lr must be > 0"),
    ("--optim.lr=-1e-6", r"optim.lr must be > 0"),
    ("--optim.state_dtype=float16", r"optim.state_dtype.*float32.*bfloat16"),
    ("--quant.scheme=w5a5", r"quant.scheme: unknown quantization scheme 'w5a5' \(did you mean 'w4a16'\?\); schemes: bf16, w8a8-int8"),
    ("--algo.correction=tiss", r"unknown algo.correction 'tiss' \(did you mean 'tis'\?\); corrections: none, tis"),
    ("--algo.correction=tis", r"algo.correction=tis does not apply to algo.loss=tbpo; it takes none, seq-tis, mis"),
    ("--algo.loss=sapo --algo.correction=acr", r"does not apply to algo.loss=sapo; it takes none, tis, decoupled, icepop"),
    ("--algo.correction=icepop --algo.loss=ppo --algo.reject=sequence", r"already rejects at the token level"),
    ("--algo.weight_high=1.5 --algo.loss=ppo", r"algo correction fields: weight_low / weight_high bound importance"),
    ("--algo.weights=token", r"algo.loss=tbpo weighs whole responses: set algo.weights to sequence or geometric"),
    ("--algo.veto=3", r"veto must lie in \(0, 1\)"),
    ("--algo.reject=token --algo.reject_low=2", r"0 <= low <= 1 <= high"),
    ("--algo.loss=gspo --algo.correction=tis", r"does not apply to algo.loss=gspo; it takes none, seq-tis, mis"),
    ("--algo.error_surprise=-1", r"algo.error_surprise must be >= 0 \(nats\), got -1.0: set --algo.error_surprise to 0"),
    ("--algo.error_gap=nan", r"algo.error_gap must be >= 0 \(nats\), got nan"),
    ("--algo.error_window=0 --algo.error_min_bad=0", r"algo.error_window must be >= 1, got 0"),
    ("--algo.error_min_bad=0", r"algo.error_min_bad must be in \[1, algo.error_window=8\], got 0: set "
                               r"--algo.error_min_bad between 1 \(any single bad token\) and 8"),
    ("--algo.error_window=2", r"algo.error_min_bad must be in \[1, algo.error_window=2\], got 3.*raise "
                              r"--algo.error_window"),
    ("--algo.truncate_at_error=maybe", r"algo.truncate_at_error: expected true/false"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_values_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, flags.split())


@pytest.mark.parametrize("flags", [
    "--trainer.save_every=0 --trainer.eval_every=0 --data.reward_workers=0",  # 0 = never / inline
    "--rollout.temperature=0 --rollout.top_p=1",
    "--quant.mode=bf16 --quant.scheme=nvfp4",  # the scheme is unused in bf16 mode: no complaint
    "--algo.loss=ppo --algo.correction=acr",
    "--algo.loss=gspo --algo.correction=mis",
    "--algo.truncate_at_error=true --algo.error_surprise=0 --algo.error_gap=0 --algo.error_window=1 "
    "--algo.error_min_bad=1",
    "--algo.error_window=3 --algo.error_min_bad=3",
])
def test_edge_values_are_accepted(flags):
    load_run_config(None, flags.split())


def test_error_threshold_defaults_are_the_detectors():
    """The algo.error_* defaults are quarl.algos.errors' own (the two must not drift apart)."""
    import inspect

    from quarl.algos.errors import garbled_starts

    algo = load_run_config(None, []).algo
    defaults = {k: p.default for k, p in inspect.signature(garbled_starts).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults == {"surprise": algo.error_surprise, "gap": algo.error_gap, "window": algo.error_window,
                        "min_bad": algo.error_min_bad}
    assert algo.truncate_at_error is False


def test_dry_run_fails_on_a_bad_value():
    r = subprocess.run([sys.executable, "-m", "quarl", "train", "--dry-run", "--quant.scheme=w5a5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("quarl train: error: quant.scheme: unknown quantization scheme 'w5a5' (did you mean 'w4a16'?)")
    assert "Traceback" not in r.stderr and r.stdout == ""
