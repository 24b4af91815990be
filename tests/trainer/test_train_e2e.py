"""End to end: the training loop on a tiny built-in model, every mode, resume, crashes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quarl.config import load_run_config
from quarl.model.loading import load_model
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.loop import Trainer

TINY = [
    "--model.builtin=tiny", "--trainer.prompts_per_step=4", "--rollout.n=4", "--rollout.max_new_tokens=12",
    "--trainer.sft_warmup_steps=40", "--trainer.eval_every=0", "--trainer.save_every=0", "--optim.lr=1e-3",
    "--data.num_train=200", "--data.num_eval=8", "--data.reward_workers=0", "--trainer.tensorboard=false",
    "--data.reward=tests.trainer.reward_fns:digit_one",
]


def _train(run_dir, *overrides, steps=2, resume=False):
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={run_dir}", f"--trainer.steps={steps}", *overrides])
    trainer = Trainer(cfg, resume=resume)
    trainer.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.learner.model.state_dict().items()}


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """The same seed in the three modes (rollout and aligned with w4a16)."""
    out = {}
    for mode in ("bf16", "rollout", "aligned"):
        run_dir = tmp_path_factory.mktemp(mode)
        trainer, rows = _train(run_dir, f"--quant.mode={mode}", "--quant.scheme=w4a16", "--algo.loss=ppo")
        out[mode] = (trainer, rows, run_dir)
    return out


def test_every_mode_trains_and_changes_weights(mode_runs):
    for mode, (trainer, rows, run_dir) in mode_runs.items():
        assert len(rows) == 2
        for key in ("reward/mean", "mismatch/kl_k3", "loss/policy", "entropy", "grad_norm", "time/rollout",
                    "time/learner", "time/publish", "time/step", "rollout/tokens_per_s", "response/len_mean",
                    "response/repeat_frac", "tbpo/drop_frac_pos", "acc/mean"):
            assert key in rows[-1], (mode, key)
        start = load_model(run_dir / "warmstart")  # the step-0 policy
        now = trainer.learner.model.state_dict()
        changed = [k for k, v in start.state_dict().items() if not torch.equal(v, now[k])]
        assert changed, mode


def test_mismatch_by_mode(mode_runs):
    kl = {m: max(r["mismatch/kl_k3"] for r in rows) for m, (_, rows, _) in mode_runs.items()}
    assert kl["bf16"] < 1e-9
    assert kl["rollout"] > 1e-6
    assert kl["aligned"] < kl["rollout"] / 100
    assert "quant/update_visible_frac" in mode_runs["aligned"][1][-1]


def test_resume_is_exact(tmp_path):
    straight, rows6 = _train(tmp_path / "a", "--trainer.save_every=3", steps=6)
    _train(tmp_path / "b", "--trainer.save_every=3", steps=3)
    resumed, rows = _train(tmp_path / "b", "--trainer.save_every=3", steps=6, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    volatile = ("time/", "rollout/tokens_per_s", "memory/")
    for a, b in zip(rows6, rows):
        ka = {k: v for k, v in a.items() if not k.startswith(volatile)}
        kb = {k: v for k, v in b.items() if not k.startswith(volatile)}
        assert ka == kb, a["step"]
    wa, wb = _weights(straight), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_crash_while_writing_checkpoint_keeps_previous(tmp_path, monkeypatch):
    trainer, _ = _train(tmp_path, steps=1)
    first = ckpt.latest_checkpoint(tmp_path)
    assert first is not None and first.name == "step_000001"

    def broken_save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    trainer.step = 2
    with pytest.raises(OSError):
        trainer.save()
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path) == first
    state = ckpt.load_checkpoint(first)
    assert state["step"] == 1
    resumed = Trainer(load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=2"]),
                      resume=True)
    assert resumed.step == 1


def test_hanging_reward_is_cut_off(tmp_path, monkeypatch):
    monkeypatch.setenv("QUARL_TEST_HANG_MARKER", str(tmp_path / "hung"))
    _, rows = _train(tmp_path / "run", "--data.reward=tests.trainer.reward_fns:hang_once",
                     "--data.reward_workers=2", "--data.reward_timeout_s=1.0", steps=1)
    assert rows[0]["reward/timeouts"] == 1.0


def test_cli_train_dry_run_and_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "quarl", "train", "--dry-run", "--rollout.n=3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "n: 3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "quarl", "train", "--rollout.temprature=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did you mean 'temperature'" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "quarl", "train", "--quiet", *TINY, f"--trainer.run_dir={tmp_path}", "--trainer.steps=1"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "finished 1 steps" in r.stdout
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert ckpt.latest_checkpoint(tmp_path) is not None
