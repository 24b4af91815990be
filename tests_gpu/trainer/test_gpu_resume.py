"""--resume on a GPU: the checkpoint is read to the CPU and copied into the learner, and the
random generator states (torch's, CUDA's, the stochastic rounding's) are restored from it."""

from __future__ import annotations

import json

import pytest

from quarl.config import load_run_config
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.loop import Trainer

RUN = ["--model.builtin=tiny", "--trainer.prompts_per_step=4", "--rollout.n=4", "--rollout.max_new_tokens=12",
       "--trainer.sft_warmup_steps=0", "--trainer.eval_every=0", "--trainer.save_every=1", "--optim.lr=1e-4",
       "--data.num_train=64", "--data.num_eval=8", "--data.reward_workers=0", "--trainer.tensorboard=false",
       "--data.reward=tests.trainer.reward_fns:digit_one", "--model.dtype=bfloat16"]
VOLATILE = ("time/", "wall", "rollout/tokens_per_s", "memory/", "perf/", "mismatch/engine_check")


def _train(run_dir, *more, steps, resume=False):
    cfg = load_run_config(None, RUN + [f"--trainer.run_dir={run_dir}", f"--trainer.steps={steps}", *more])
    trainer = Trainer(cfg, resume=resume)
    assert trainer.device.type == "cuda"
    trainer.run()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lean", [False, True], ids=["fp32-master", "bf16-stochastic-rounding"])
def test_resume_on_the_gpu_continues_the_run(tmp_path, lean):
    more = ["--optim.fp32_master=false", "--optim.state_dtype=bfloat16"] if lean else []
    straight = _train(tmp_path / "a", *more, steps=2)
    _train(tmp_path / "b", *more, steps=1)
    resumed = _train(tmp_path / "b", *more, steps=2, resume=True)
    assert [r["step"] for r in resumed] == [1, 2]
    for x, y in zip(straight, resumed):
        for k in (k for k in x if not k.startswith(VOLATILE)):
            assert y[k] == pytest.approx(x[k], rel=1e-3, abs=1e-5), (x["step"], k)
    wa = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "a"))["learner"]["model"]
    wb = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "b"))["learner"]["model"]
    for n in wa:  # the same steps: apart only where a GPU reduction's order flipped an Adam step (2 lr)
        off = (wa[n].float() - wb[n].float()).abs()
        assert (off > 1e-3).float().mean() < 1e-2 and off.max() < 5e-2, n
