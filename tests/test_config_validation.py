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
    ("--quant.scheme=w5a5", r"quant.scheme: unknown quantization scheme 'w5a5' \(did you mean 'w4a16'\?\); "
                            r"schemes: bf16, w8a8-int8"),
    ("--algo.correction=tiss", r"unknown algo.correction 'tiss' \(did you mean 'tis'\?\); corrections: none, tis"),
    ("--algo.correction=tis", r"algo.correction=tis does not apply to algo.loss=tbpo; it takes none, seq-tis, mis"),
    ("--algo.loss=sapo --algo.correction=acr",
     r"does not apply to algo.loss=sapo; it takes none, tis, decoupled, icepop"),
    ("--algo.correction=icepop --algo.loss=ppo --algo.reject=sequence", r"already rejects at the token level"),
    ("--algo.weight_high=1.5 --algo.loss=ppo", r"algo correction fields: weight_low / weight_high bound importance"),
    ("--algo.weights=token", r"algo.loss=tbpo weighs whole responses: set algo.weights to sequence or geometric"),
    ("--algo.veto=3", r"veto must lie in \(0, 1\)"),
    ("--algo.reject=token --algo.reject_low=2", r"0 <= low <= 1 <= high"),
    ("--algo.loss=gspo --algo.correction=tis", r"does not apply to algo.loss=gspo; it takes none, seq-tis, mis"),
    ("--algo.error_surprise=-1",
     r"algo.error_surprise must be >= 0 \(nats\), got -1.0: set --algo.error_surprise to 0"),
    ("--algo.error_gap=nan", r"algo.error_gap must be >= 0 \(nats\), got nan"),
    ("--algo.error_window=0 --algo.error_min_bad=0", r"algo.error_window must be >= 1, got 0"),
    ("--algo.error_min_bad=0", r"algo.error_min_bad must be in \[1, algo.error_window=8\], got 0: set "
                               r"--algo.error_min_bad between 1 \(any single bad token\) and 8"),
    ("--algo.error_window=2", r"algo.error_min_bad must be in \[1, algo.error_window=2\], got 3.*raise "
                              r"--algo.error_window"),
    ("--algo.truncate_at_error=maybe", r"algo.truncate_at_error: expected true/false"),
    # the clip band and the other algorithm coefficients
    ("--algo.eps_low=-1", r"algo.eps_low must be in \[0, 1\), got -1.0 \(the clip band's lower distance, 1 - x\): "
                          r"set --algo.eps_low to a value in \[0, 1\)"),
    ("--algo.eps_low=1", r"algo.eps_low must be in \[0, 1\).*got 1.0"),
    ("--algo.eps_low=nan", r"algo.eps_low must be in \[0, 1\).*got nan"),
    ("--algo.delta_low=2", r"algo.delta_low must be in \[0, 1\).*got 2.0"),
    ("--algo.eps_high=-0.1", r"algo.eps_high must be >= 0, got -0.1: set --algo.eps_high to 0 or more"),
    ("--algo.delta_high=-1", r"algo.delta_high must be >= 0, got -1.0"),
    ("--algo.dual_clip_c=0.5", r"algo.dual_clip_c must be > 1 .*got 0.5: set --algo.dual_clip_c above 1"),
    ("--algo.tau_pos=0", r"algo.tau_pos must be > 0, got 0.0"),
    ("--algo.tau_neg=-1", r"algo.tau_neg must be > 0, got -1.0"),
    ("--algo.kl_coef=-0.1", r"algo.kl_coef must be >= 0, got -0.1"),
    ("--algo.value_coef=-1", r"algo.value_coef must be >= 0, got -1.0"),
    ("--algo.gamma=1.5", r"algo.gamma must be in \[0, 1\], got 1.5 \(GAE's discount / trace decay\)"),
    ("--algo.lam=-0.5", r"algo.lam must be in \[0, 1\].*got -0.5"),
    # quantization: patterns that select nothing, a scale that is no scale
    ("--quant.include=5", r"quant.include pattern '5' matches no linear layer: patterns are fnmatch globs over "
                          r"module names, e.g. layers.\* \(every decoder linear, the default include\)"),
    ("--quant.exclude=*.down", r"quant.exclude pattern '\*.down' matches no linear layer"),
    ("--quant.exclude=layers.*", r"quant.include=\['layers.\*'\] minus quant.exclude=\['layers.\*'\] selects no "
                                 r"linear layer: quant.mode=aligned would quantize nothing"),
    ("--quant.uaq_scale=0", r"quant.uaq_scale must be > 0, got 0.0"),
    # optimizer and warm start
    ("--optim.grad_clip=0", r"optim.grad_clip must be > 0, got 0.0"),
    ("--optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0, got -0.1"),
    ("--optim.warmup_steps=-1", r"optim.warmup_steps must be >= 0, got -1"),
    ("--optim.muon_lr=-1", r"optim.muon_lr must be > 0, got -1.0"),
    ("--optim.betas=1.5,0.9", r"optim.betas must be two numbers in \[0, 1\) \(AdamW's beta1, beta2\), got "
                              r"\[1.5, 0.9\]: set e.g. --optim.betas=0.9,0.999"),
    ("--optim.betas=0.9", r"optim.betas must be two numbers.*got \[0.9\]"),
    ("--trainer.sft_lr=0", r"trainer.sft_lr must be > 0, got 0.0"),
    ("--trainer.sft_warmup_steps=-1", r"trainer.sft_warmup_steps must be >= 0, got -1"),
    ("--trainer.log_samples=-1", r"trainer.log_samples must be >= 0, got -1"),
    # data and rollout sizes
    ("--data.num_eval=-1", r"data.num_eval must be >= 0, got -1"),
    ("--data.max_prompt_len=0", r"data.max_prompt_len must be >= 1, got 0"),
    ("--data.difficulty=0", r"data.difficulty must be >= 1, got 0"),
    ("--rollout.n=0", r"rollout.n must be >= 1, got 0: set --rollout.n to 1 or more"),
    ("--rollout.engine.block_size=0", r"rollout.engine.block_size must be >= 1, got 0"),
    ("--rollout.engine.max_num_seqs=0", r"rollout.engine.max_num_seqs must be >= 1, got 0"),
    ("--rollout.engine.num_kv_blocks=0", r"rollout.engine.num_kv_blocks must be >= 1, got 0"),
    ("--rollout.engine.gpu_memory_utilization=0", r"rollout.engine.gpu_memory_utilization must be in \(0, 1\], "
                                                  r"got 0.0 \(a share of the GPU's memory\)"),
    ("--quant.exact_update=twice", r"quant.exact_update='twice': choose recompute or autograd"),
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
    "--algo.eps_low=0 --algo.eps_high=0 --algo.delta_low=0.999 --algo.dual_clip_c=1.01 --algo.gamma=0 --algo.lam=1",
    "--quant.include=lm_head", "--quant.include=layers.1?.* --quant.exclude=*.down_proj",
    "--quant.mode=bf16 --quant.exclude=layers.*",  # bf16 quantizes nothing anyway
    "--quant.mode=bf16 --quant.exact=true --quant.exact_update=autograd",
    "--optim.betas=0,0.999 --optim.weight_decay=0 --optim.warmup_steps=0 --data.num_eval=0",
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
    assert r.stderr.startswith(
        "quarl train: error: quant.scheme: unknown quantization scheme 'w5a5' (did you mean 'w4a16'?)")
    assert "Traceback" not in r.stderr and r.stdout == ""
