"""``quant.exact=true`` in a training run: the built-in tiny model in bfloat16 on the CPU (the
batch-invariant kernels under Triton's interpreter), 2 steps each. The learner's log-probs of
the engine's samples equal the engine's bit for bit at every step: ``mismatch/kl_k3`` and
``mismatch/max_abs_logp_diff`` are exactly 0, whether they come from the update's own forward
(autograd on) or from a separate old-log-prob pass: LoRA on an aligned w4a16 base (the shared
frozen codes, the adapters published at each step) with the fp8 KV cache, two mini-batches, a
temperature and a nucleus cut; and the MoE preset in aligned w4a16 with r3 routing replay (the
routers agree on every token). The same run without exact mode has a non-zero difference (what the
check would catch); an exact run whose engine is broken on purpose (one layer's weights moved
after each publish) warns, naming the first token that parted and that layer."""

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
    "exact-lora-aligned-w4a16-kvfp8-oldlogp": [
        "--quant.exact=true", "--quant.mode=aligned", "--quant.scheme=w4a16", "--model.lora_rank=4",
        "--rollout.engine.kv_cache_dtype=fp8", "--trainer.mini_batches=2", "--rollout.temperature=0.8",
        "--rollout.top_p=0.9"],
    # IcePop's rejection, one optimizer step: the sampler's log-probs stand in for the old-logp pass
    "exact-moe-aligned-w4a16-r3-icepop": ["--quant.exact=true", "--model.builtin=moe-tiny", "--quant.mode=aligned",
                                          "--quant.scheme=w4a16", "--rollout.routing_replay=r3",
                                          "--algo.loss=ppo", "--algo.correction=icepop", "--trainer.sft_warmup_steps=0",
                                          "--rollout.max_new_tokens=4"],
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
        if "moe" in name:
            assert row["moe/route_agreement"] == 1.0 and row["mismatch/kl_k3_noreplay"] == 0.0
        if "icepop" in name:
            assert row["correction/drop_frac"] == 0.0


def test_an_exact_run_that_parts_warns_naming_the_token_and_the_layer(tmp_path, monkeypatch, capsys):
    from quarl.trainer.weights import Publisher

    publish = Publisher.publish

    def broken(self):
        out = publish(self)
        with torch.no_grad():  # the engine's copy of layer 1's down projection, off by 1%
            self.engine.model.layers[1].mlp.down_proj.weight.mul_(1.01)
        return out

    monkeypatch.setattr(Publisher, "publish", broken)
    rows = _train(tmp_path, ["--quant.exact=true"])
    assert all(row["mismatch/max_abs_logp_diff"] > 0 for row in rows)
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert "step 1: quant.exact=true, yet the sampler's and the learner's log-probs differ" in out
    assert "step 2: quant.exact=true" in out and "first at response 0, the token at position" in out
    assert out.count("the forwards part at layers.1 (token") == 1  # (located once a run)
