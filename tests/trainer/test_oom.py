"""A step that runs out of GPU memory: the stage that ran out and the settings that lower it."""

from __future__ import annotations

import pytest
import torch

from quarl.config import load_run_config
from quarl.trainer import checkpoint as ckpt
from quarl.trainer import oom
from quarl.trainer.loop import Trainer
from tests.trainer.test_train_e2e import TINY

TORCH_SAYS = ("CUDA out of memory. Tried to allocate 526.00 MiB. GPU 2 has a total capacity of 79.18 GiB of which "
              "300.06 MiB is free. Including non-PyTorch memory, this process has 78.88 GiB memory in use.")


def _cfg(*flags):
    return load_run_config(None, ["--trainer.token_budget=4096", *flags])


def test_learner_advice_offers_only_what_would_lower_its_memory():
    lean = oom.MemoryState(kv_kept=False, world=4, sharded=True)
    msg = oom.advice("learner", 7, torch.OutOfMemoryError(TORCH_SAYS), _cfg(), oom.MemoryState(True, 2, False))
    assert msg.startswith("the learner's update ran out of GPU memory in step 7 (Tried to allocate 526.00 MiB. GPU 2 "
                          "has a total capacity of 79.18 GiB of which 300.06 MiB is free)")
    for fix in ("--trainer.token_budget=2048 (now 4096", "--trainer.activation_checkpointing=true",
                "--rollout.kv_cache_in_update=release", "--optim.fp32_master=false", "--trainer.shard_learner=true"):
        assert fix in msg, fix
    msg = oom.advice("learner", 7, torch.OutOfMemoryError("CUDA out of memory."),
                     _cfg("--trainer.token_budget=256", "--trainer.activation_checkpointing=true",
                          "--optim.fp32_master=false", "--optim.state_dtype=bfloat16"), lean)
    assert "(" not in msg.splitlines()[0]  # (torch's numbers only where it gave them)
    assert msg.splitlines()[1:] == ["  more GPUs (a sharded learner's share of the state shrinks with each rank)"]


def test_publish_and_engine_advice():
    state = oom.MemoryState(kv_kept=False, world=1, sharded=False)
    msg = oom.advice("publish", 3, torch.OutOfMemoryError(TORCH_SAYS), _cfg(), state)
    assert msg.startswith("publishing the new weights to the engine ran out")
    assert "token_budget" not in msg and "activation_checkpointing" not in msg and "fp32_master=false" in msg
    msg = oom.advice("rollout", 3, torch.OutOfMemoryError(TORCH_SAYS),
                     _cfg("--rollout.engine.gpu_memory_utilization=0.5"), state)
    assert "--rollout.engine.gpu_memory_utilization=0.4 (now 0.5" in msg
    assert "--rollout.engine.max_num_batched_tokens=8192 (now 16384" in msg
    assert "--rollout.engine.max_num_seqs=128" in msg
    msg = oom.advice("kv_cache", 3, torch.OutOfMemoryError(TORCH_SAYS), _cfg(), state)
    assert msg.startswith("re-creating the engine's KV cache") and len(msg.splitlines()) == 2


@pytest.mark.parametrize("stage", ["learner", "publish"])
def test_a_step_out_of_memory_names_its_stage_and_keeps_the_checkpoint(tmp_path, stage, monkeypatch, capsys):
    """The error names the stage (the innermost one that was running), the run's last
    checkpoint stays intact, and the CLI says what to change and how to continue."""
    from quarl.cli.train import _run_main

    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=2"])
    trainer = Trainer(cfg)
    trainer.train_step()  # (step 1, saved as the run's checkpoint)
    trainer.step += 1
    trainer.save()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_SAYS)

    if stage == "learner":
        monkeypatch.setattr(trainer, "update_policy", out_of_memory)
    else:
        monkeypatch.setattr(trainer.publisher, "publish", out_of_memory)
    with pytest.raises(oom.OutOfGPUMemory, match=f"^{oom.STAGES[stage]} ran out of GPU memory in step 2 "):
        trainer.train_step()
    assert _run_main(trainer, cfg) == 1
    err = capsys.readouterr().err
    assert f"quarl train: error: {oom.STAGES[stage]} ran out of GPU memory in step 2" in err
    assert ("its newest checkpoint, step_000001, is intact: change the setting, then continue with: quarl train "
            f"--resume --trainer.run_dir={tmp_path} --<setting>=<value>") in err
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000001"]
    trainer.rewards.close()
