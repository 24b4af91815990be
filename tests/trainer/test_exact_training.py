"""``quant.exact=true`` in a training run: the built-in tiny model in bfloat16 on the CPU (the
batch-invariant kernels under Triton's interpreter), 2 steps each. The learner's log-probs of
the engine's samples equal the engine's bit for bit at every step: ``mismatch/kl_k3`` and
``mismatch/max_abs_logp_diff`` are exactly 0, whether they come from the update's own forward
(autograd on) or from a separate old-log-prob pass, with the fp8 KV cache, a temperature and
a nucleus cut, and in aligned mode with w4a16 (the learner's
QAT linears and the engine's packed linears on the codes published at each step). The same
run without exact mode has a non-zero difference (what the check would catch)."""

from __future__ import annotations

import json

import pytest
import torch

from quarl.config import load_run_config
from quarl.trainer.loop import Trainer

TINY = [
    "--model.builtin=tiny", "--model.dtype=bfloat16", "--quant.mode=bf16", "--trainer.prompts_per_step=2",
    "--rollout.n=4", "--rollout.max_new_tokens=8", "--trainer.sft_warmup_steps=4", "--trainer.eval_every=0",
    "--trainer.save_every=0", "--optim.lr=1e-3", "--data.num_train=200", "--data.num_eval=8",
    "--data.reward_workers=0", "--trainer.tensorboard=false", "--data.reward=tests.trainer.reward_fns:digit_one",
    "--trainer.steps=2",
]
RUNS = {
    "exact": ["--quant.exact=true"],
    "exact-kvfp8-oldlogp": ["--quant.exact=true", "--rollout.engine.kv_cache_dtype=fp8", "--trainer.mini_batches=2",
                            "--rollout.temperature=0.8", "--rollout.top_p=0.9"],
    "exact-aligned-w4a16": ["--quant.exact=true", "--quant.mode=aligned", "--quant.scheme=w4a16"],
    "not-exact": ["--quant.exact=false"],
}


def _train(run_dir, flags: list[str]) -> list[dict]:
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={run_dir}", *flags])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the interpreter is one Python thread: two test workers share 2 cores)
    try:
        Trainer(cfg).run()
    finally:
        torch.set_num_threads(threads)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(RUNS))
def test_exact_mode_has_no_mismatch_at_any_step(tmp_path, name):
    rows = _train(tmp_path, RUNS[name])
    assert len(rows) == 2
    for row in rows:
        assert row["response/len_mean"] > 0 and row["loss/policy"] == row["loss/policy"]  # (not NaN)
        diff, kl = row["mismatch/max_abs_logp_diff"], row["mismatch/kl_k3"]
        if name == "not-exact":
            assert diff > 0  # bfloat16 decode vs recompute: the ordinary kernels round otherwise
        else:
            assert diff == 0.0 and kl == 0.0, (name, rows.index(row), diff, kl)
