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


def _cli_train(run_dir, *args):
    r = subprocess.run(
        [sys.executable, "-m", "quarl", "train", "--quiet", *TINY, f"--trainer.run_dir={run_dir}", *args],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint_weights(run_dir):
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))
    return state["learner"]["model"]


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """The same seed in the three modes (rollout and aligned with w4a16), through the CLI."""
    out = {}
    for mode in ("bf16", "rollout", "aligned"):
        run_dir = tmp_path_factory.mktemp(mode)
        rows = _cli_train(run_dir, "--trainer.steps=2", f"--quant.mode={mode}", "--quant.scheme=w4a16",
                          "--algo.loss=ppo")
        out[mode] = (_checkpoint_weights(run_dir), rows, run_dir)
    return out


def test_every_mode_trains_and_changes_weights(mode_runs):
    for mode, (weights, rows, run_dir) in mode_runs.items():
        assert len(rows) == 2
        for key in ("reward/mean", "mismatch/kl_k3", "loss/policy", "entropy", "grad_norm", "time/rollout",
                    "time/learner", "time/publish", "time/step", "rollout/tokens_per_s", "response/len_mean",
                    "response/repeat_frac", "tbpo/drop_frac_pos", "acc/mean", "perf/micro_batches",
                    "errors/response_frac", "errors/first_pos", "errors/token_frac_after"):
            assert key in rows[-1], (mode, key)
        last = rows[-1]
        assert last["perf/micro_batches"] >= 1 and 0 < last["perf/micro_batch_fill"] <= 1
        assert 0 <= last["perf/padding_frac"] < 1
        start = load_model(run_dir / "warmstart")  # the step-0 policy
        changed = [k for k, v in start.state_dict().items() if not torch.equal(v, weights[k])]
        assert changed, mode


def test_mismatch_by_mode(mode_runs):
    kl = {m: max(r["mismatch/kl_k3"] for r in rows) for m, (_, rows, _) in mode_runs.items()}
    assert kl["bf16"] < 1e-9
    assert kl["rollout"] > 1e-6
    assert kl["aligned"] < kl["rollout"] / 100
    assert "quant/update_visible_frac" in mode_runs["aligned"][1][-1]


def test_resume_is_exact(tmp_path):
    """6 steps straight == 3 steps, then --resume for 3 more (metrics and weights)."""
    rows6 = _cli_train(tmp_path / "a", "--trainer.save_every=3", "--trainer.steps=6")
    _cli_train(tmp_path / "b", "--trainer.save_every=3", "--trainer.steps=3")
    rows = _cli_train(tmp_path / "b", "--trainer.save_every=3", "--trainer.steps=6", "--resume")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    volatile = ("time/", "wall", "perf/eval_s", "perf/setup_s", "rollout/tokens_per_s", "memory/",
                "perf/learner_tflops", "perf/learner_mfu", "perf/compiles",
                "perf/compile_s", "perf/gc_")
    for a, b in zip(rows6, rows):
        ka = {k: v for k, v in a.items() if not k.startswith(volatile)}
        kb = {k: v for k, v in b.items() if not k.startswith(volatile)}
        assert ka == kb, a["step"]
    wa, wb = _checkpoint_weights(tmp_path / "a"), _checkpoint_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resume_shapes_the_random_base_without_drawing_it(tmp_path, monkeypatch):
    """A full fine-tune's checkpoint holds every weight: its resume makes the built-in model's
    shape and does not draw the random numbers it overwrites, and continues exactly; with a KL
    reference (which is the base) it draws them."""
    from quarl.trainer import setup

    drawn = []
    real = setup.build_random_model
    monkeypatch.setattr(setup, "build_random_model", lambda *a, **k: drawn.append(1) or real(*a, **k))
    sft0, volatile = ["--trainer.sft_warmup_steps=0", "--trainer.save_every=1"], ("time/", "wall", "perf/", "memory/",
                                                                                  "rollout/tokens_per_s")
    _, straight = _train(tmp_path / "a", *sft0, steps=2)
    _train(tmp_path / "b", *sft0, steps=1)
    assert len(drawn) == 2
    _, rows = _train(tmp_path / "b", *sft0, steps=2, resume=True)
    assert len(drawn) == 2  # (the resume drew nothing)
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows] == \
        [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in straight]
    wa, wb = _checkpoint_weights(tmp_path / "a"), _checkpoint_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    _train(tmp_path / "c", *sft0, "--algo.kl_coef=0.1", steps=1)
    _train(tmp_path / "c", *sft0, "--algo.kl_coef=0.1", steps=2, resume=True)
    assert len(drawn) == 4


# the memory-lean learner: bf16 weights stepped directly (stochastic rounding), bf16 Adam moments,
# activation checkpointing
LEAN = ["--optim.fp32_master=false", "--optim.state_dtype=bfloat16", "--trainer.activation_checkpointing=true"]


def test_lean_memory_options_resume_exactly(tmp_path):
    """bf16 model, bf16 moments, stochastic rounding: 2 steps straight == 1 step, then --resume
    for 1 more with activation checkpointing turned on (accepted: it recomputes the same values)."""
    lean = ["--model.dtype=bfloat16", "--optim.fp32_master=false", "--optim.state_dtype=bfloat16",
            "--trainer.sft_warmup_steps=0", "--trainer.save_every=1"]
    _, straight = _train(tmp_path / "a", *lean, steps=2)
    _train(tmp_path / "b", *lean, steps=1)
    trainer, rows = _train(tmp_path / "b", *lean, "--trainer.activation_checkpointing=true", steps=2, resume=True)
    assert type(trainer.learner.optimizer).__name__ == "LeanAdamW"
    volatile = ("time/", "wall", "perf/eval_s", "perf/setup_s", "rollout/tokens_per_s", "memory/",
                "perf/learner_tflops", "perf/learner_mfu", "perf/compiles",
                "perf/compile_s", "perf/gc_")
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows] == \
        [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in straight]
    wa, wb = _checkpoint_weights(tmp_path / "a"), _checkpoint_weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("extra", [
    ["--trainer.dynamic_sampling=true", "--trainer.overlong_filter=true"],
    ["--algo.kl_coef=0.1", "--algo.loss=gspo", "--algo.correction=mis"],
    ["--algo.advantage=gae", "--algo.loss=ppo", "--trainer.ppo_epochs=2", "--trainer.mini_batches=2"],
    ["--optim.name=muon", "--quant.uaq_scale=1.5", "--algo.loss=ppo", "--algo.correction=acr"],
    ["--quant.scheme=w8a8-int8", "--algo.loss=sapo", "--algo.advantage=rloo", "--trainer.on_policy=true"],
    ["--model.dtype=bfloat16", "--optim.lr=1e-6", "--algo.advantage=gae", "--algo.loss=ppo"],
    ["--model.dtype=bfloat16", *LEAN, "--optim.name=muon", "--algo.advantage=gae", "--algo.loss=ppo",
     "--trainer.sft_warmup_steps=0"],
], ids=["dapo", "kl-gspo-mis", "gae-critic", "muon-uaq-acr", "int8-sapo-rloo", "bf16-fp32-master",
        "bf16-lean-muon-critic"])
def test_trainer_variants_run(tmp_path, extra):
    trainer, rows = _train(tmp_path, *extra, steps=2)
    assert len(rows) == 2
    assert all(v is None or isinstance(v, (int, float)) for v in rows[-1].values())
    assert rows[-1]["train/skipped_updates"] == 0.0
    if "--algo.kl_coef=0.1" in extra:
        assert "loss/kl" in rows[-1]
    if "--algo.advantage=gae" in extra:
        assert "loss/value" in rows[-1]
    if "--trainer.dynamic_sampling=true" in extra:
        assert "dapo/dropped_groups" in rows[-1]
    if "--optim.fp32_master=false" in extra:
        assert trainer.learner.master is None and trainer.learner.critic_master is None
    elif "--model.dtype=bfloat16" in extra:
        assert trainer.learner.master is not None
        state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["learner"]
        assert "master" in state and "critic_master" in state


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
        [sys.executable, "-m", "quarl", "train", "--quiet", *TINY, f"--trainer.run_dir={tmp_path}",
         "--trainer.steps=1"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "finished 1 steps" in r.stdout
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert ckpt.latest_checkpoint(tmp_path) is not None


def test_ctrl_c_writes_final_checkpoint_and_eval_cli(tmp_path):
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "quarl", "train", "--quiet", *TINY, f"--trainer.run_dir={tmp_path}",
         "--trainer.steps=500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    done = len(metrics.read_text().splitlines())
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and ckpt.load_checkpoint(latest)["step"] == done >= 2  # the step in flight was finished

    r = subprocess.run([sys.executable, "-m", "quarl", "eval", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert 0.0 <= out["eval/acc"] <= 1.0 and out["step"] == ckpt.load_checkpoint(latest)["step"]


def test_engine_check_catches_stale_weights(tmp_path):
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=1", "--quant.mode=bf16"])
    trainer = Trainer(cfg)
    assert trainer.sync_error < 1e-4
    with torch.no_grad():  # the learner moves on, the engine is not told
        trainer.learner.model.lm_head_weight.mul_(3.0)
    with pytest.raises(RuntimeError, match="disagree after publishing"):
        trainer._check_engine_sync()
    trainer.publisher.publish()
    assert trainer._check_engine_sync() < 1e-4


def test_existing_run_dir_needs_resume(tmp_path):
    _train(tmp_path, steps=1)
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        Trainer(load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=2"]))


@pytest.mark.parametrize("choice, kept", [("keep", True), ("release", False), ("auto", True)])  # auto on CPU: keep
def test_kv_cache_through_the_learner_phase(tmp_path, choice, kept):
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=2",
                                        f"--rollout.kv_cache_in_update={choice}"])
    trainer = Trainer(cfg)
    kv = trainer.engine.runner.kv
    publish, cache_at_publish = trainer.publisher.publish, []

    def publish_and_look():  # released: the cache comes back only after the publish (a sharded one gathers)
        cache_at_publish.append(trainer.engine.runner.kv is not None)
        return publish()

    trainer.publisher.publish = publish_and_look
    trainer.train_step()
    trainer.step += 1
    assert (trainer.engine.runner.kv is kv) == kept  # kept: the same cache at the same addresses
    assert trainer.engine.runner.kv is not None
    assert cache_at_publish == [kept]
    trainer.rewards.close()


def test_update_result_model_flops_by_hand():
    from quarl.trainer.stages import UpdateResult

    # forward + backward 6 P T; each extra forward adds 2 P T: (6 + 2 * 2) * 1000 * 50 = 500000
    assert UpdateResult({}, {}, tokens=50, extra_forwards=2).model_flops(1000) == 500_000
    # LoRA: the frozen base has no weight gradient (4 + 4) * 1000 * 50, the adapters (6 + 4) * 10 * 50
    assert UpdateResult({}, {}, tokens=50, extra_forwards=2).model_flops(1000, lora_params=10) == 400_000 + 5_000


def test_fp8_kv_cache_in_aligned_mode_adds_no_mismatch(tmp_path):
    """rollout.engine.kv_cache_dtype=fp8: the aligned learner rounds K/V as the cache does, so
    the step's mismatch stays at the aligned level; a bf16-mode learner (which does not mirror
    the cache) sees the cache's rounding as mismatch."""
    kl = {}
    for mode in ("aligned", "bf16"):
        trainer, rows = _train(tmp_path / mode, f"--quant.mode={mode}", "--quant.scheme=w4a16", "--algo.loss=ppo",
                               "--rollout.engine.kv_cache_dtype=fp8", steps=1)
        assert trainer.engine.runner.kv.quantized
        assert trainer.learner.model.kv_quant == ("fp8" if mode == "aligned" else None)
        kl[mode] = rows[-1]["mismatch/kl_k3"]
        trainer.rewards.close()
    assert kl["bf16"] > 1e-6 and kl["aligned"] < kl["bf16"] / 100, kl


def test_dense_engine_weights_are_announced_and_train(tmp_path):
    """``rollout.engine.dense_weights=on`` in aligned w4a16: the trainer says how much the
    engine's dense copies take, and a step runs with the engine in sync with the learner."""
    import io

    from rich.console import Console

    out = io.StringIO()
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={tmp_path}", "--trainer.steps=1", "--quant.mode=aligned",
                                        "--quant.scheme=w4a16", "--trainer.sft_warmup_steps=0",
                                        "--rollout.engine.dense_weights=on"])
    trainer = Trainer(cfg, console=Console(file=out, width=200))
    want = trainer.engine.runner.dense_weight_bytes
    assert want > 0 and f"engine keeps its w4a16 weights dense too: {want / 2**30:.1f} GB" in out.getvalue()
    trainer.train_step()
    assert trainer._check_engine_sync() < 1e-3
    trainer.rewards.close()


def test_a_kv_cache_too_small_for_the_steps_rollouts_is_counted_and_named(tmp_path, capsys):
    """rollout/preemptions counts the engine's preemptions of each step (0 with room to spare);
    the first step that has any warns once, with the setting that gives the cache more room."""
    _, roomy = _train(tmp_path / "roomy", "--trainer.sft_warmup_steps=0", steps=1)
    assert roomy[0]["rollout/preemptions"] == 0.0
    capsys.readouterr()
    # 16 rollouts of up to ~20 tokens in blocks of 16: 17 blocks hold one max-length sequence, not 16 at once
    trainer, tight = _train(tmp_path / "tight", "--trainer.sft_warmup_steps=0", "--rollout.engine.num_kv_blocks=17",
                            steps=2)
    assert trainer.engine.runner.num_blocks == 17
    assert all(r["rollout/preemptions"] > 0 for r in tight)
    err = capsys.readouterr().err
    assert err.count("could not hold the step's rollouts at once") == 1, err
    assert "Raise rollout.engine.num_kv_blocks (now 17)" in err
