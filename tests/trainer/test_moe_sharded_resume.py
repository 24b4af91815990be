"""The multi-GPU MoE run on CPU ranks (gloo): ``moe-tiny`` (8 experts, top-2) trained with the
settings of the Qwen3-30B-A3B full fine-tune (``quarl bench train --workload
moe-30b-full-sharded --modes aligned-w4a16+r3``: aligned w4a16, the engine's routes replayed,
the learner sharded with FSDP2, activation checkpointing, the KV cache released through each
update; ``LEAN``: bf16 weights and Adam moments stepped with stochastic rounding), its
checkpoint resumed on 2, 1 and 3 ranks; and the MoE engine's data-parallel rollouts on 2 ranks
against one process's, token for token."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quarl.bench.train import WORKLOADS, mode_overrides
from quarl.learner.learner import SHARDED_FORMAT
from quarl.trainer import checkpoint as ckpt
from tests.trainer.test_data_parallel import RUN, VOLATILE, _assert_same_steps, _port, _rows, _weights
from tests.trainer.test_data_parallel import ROOT as REPO
from tests.trainer.test_data_parallel import _train as launch

WORKLOAD = WORKLOADS["moe-30b-full-sharded"]
# 6 prompts a step: 1, 2 and 3 ranks split them (on 3 the 8 experts' rows no longer split evenly)
MOE_W4 = ["--model.builtin=moe-tiny", *mode_overrides("aligned-w4a16+r3"), "--trainer.prompts_per_step=6",
          "--trainer.eval_every=0"]
SHARDED = ["--trainer.shard_learner=true", "--trainer.activation_checkpointing=true",
           "--rollout.kv_cache_in_update=release"]
LR = 1e-4
# the workload's own flags (its engine's share of the GPU does nothing on a CPU) in bf16, the GPU's dtype
LEAN = [*WORKLOAD.extra, "--model.dtype=bfloat16", f"--optim.lr={LR}"]
SAVE = ["--trainer.save_every=2"]  # (and at the last step)


def _without_volatile(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _straight(run: Path, *flags: str) -> Path:
    """3 steps on 2 sharded ranks, checkpoints at steps 2 and 3."""
    res = launch(run, 2, *MOE_W4, *flags, "--trainer.steps=3", *SAVE)
    assert res.returncode == 0, res.stderr[-4000:]
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_000002", "step_000003"]
    assert len(list((ckpt.checkpoint_dir(run) / "step_000002" / "learner").glob("*.distcp"))) == 2  # one per rank
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # r3: the learner ran the engine's w4a16 experts on the engine's routes
        assert "mismatch/kl_k3_noreplay" in r and r["mismatch/kl_k3"] < 1e-5 and r["moe/route_agreement"] > 0.9, r
    return run


def _resumed(straight: Path, run: Path, ranks: int, *flags: str) -> subprocess.CompletedProcess:
    """The straight run's step-2 checkpoint (the run as if stopped after step 2) resumed on
    ``ranks`` for step 3."""
    shutil.copytree(straight, run)
    shutil.rmtree(ckpt.checkpoint_dir(run) / "step_000003")
    return launch(run, ranks, *MOE_W4, *flags, "--resume", "--trainer.steps=3", *SAVE)


def test_a_sharded_moe_checkpoint_resumes_on_one_and_on_three_ranks(tmp_path):
    """float32 weights: the step-2 checkpoint of 2 sharded ranks resumed on 1 rank (the whole
    learner) and on 3 sharded ranks (uneven shards: 3, 3 and 2 experts' rows; the engines'
    w4a16 experts gathered from them packed) gives the straight run's step 3, metrics and
    weights, to the tolerance of float32 sums in another order."""
    straight = _straight(tmp_path / "straight", *SHARDED)
    for name, ranks in (("on_one", 1), ("on_three", 3)):
        res = _resumed(straight, tmp_path / name, ranks, *SHARDED)
        assert res.returncode == 0, res.stderr[-4000:]
        _assert_same_steps(straight, tmp_path / name, [1, 2, 3])
    assert len(list((ckpt.latest_checkpoint(tmp_path / "on_three") / "learner").glob("*.distcp"))) == 3
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "on_one"))["learner"].get("format") != SHARDED_FORMAT


@pytest.fixture(scope="module")
def lean_straight(tmp_path_factory) -> Path:
    return _straight(tmp_path_factory.mktemp("lean") / "straight", *LEAN)


def test_a_lean_sharded_moe_run_resumes_bit_for_bit_and_on_three_ranks(lean_straight, tmp_path):
    """The lean settings: the step-2 checkpoint resumed on 2 ranks gives the straight run's
    step 3 and weights bit for bit (every rank's rounding generators are in the checkpoint).
    Resumed on 3 ranks, the shards cover other rows and round with other random bits: step 3's
    metrics match (the rollout and the learner's forward run on the same step-2 weights) and
    every weight and Adam moment lies within a bf16 rounding of the straight run's."""
    assert set(SHARDED) < set(LEAN) and {"--optim.fp32_master=false", "--optim.state_dtype=bfloat16"} < set(LEAN)
    res = _resumed(lean_straight, tmp_path / "on_two", 2, *LEAN)
    assert res.returncode == 0, res.stderr[-4000:]
    assert _without_volatile(_rows(tmp_path / "on_two")) == _without_volatile(_rows(lean_straight))
    wa, wb = _weights(lean_straight), _weights(tmp_path / "on_two")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    assert next(iter(wa.values())).dtype == torch.bfloat16
    start = _weights_at(lean_straight, "step_000002")
    assert any(not torch.equal(start[n], wa[n]) for n in wa)  # (step 3 moved the weights)

    res = _resumed(lean_straight, tmp_path / "on_three", 3, *LEAN)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len(list((ckpt.latest_checkpoint(tmp_path / "on_three") / "learner").glob("*.distcp"))) == 3
    _assert_within_bf16_rounding(lean_straight, tmp_path / "on_three")


def test_a_lean_sharded_moe_checkpoint_resumes_in_one_process(lean_straight, tmp_path):
    """The lean step-2 checkpoint of 2 sharded ranks resumed by one process (whole learner):
    step 3 as on 3 ranks (:func:`_assert_within_bf16_rounding`)."""
    res = _resumed(lean_straight, tmp_path / "on_one", 1, *LEAN)
    assert res.returncode == 0, res.stderr[-2000:]
    _assert_within_bf16_rounding(lean_straight, tmp_path / "on_one")


def _assert_within_bf16_rounding(straight: Path, resumed: Path) -> None:
    """Step 3 of ``resumed`` against ``straight``'s, lean settings on another rank count: its
    metrics to bf16 sums in another order (``quant/*``, statistics of the rounded weights after
    the update, more loosely), each weight within one bf16 ulp (of either value) plus a tenth
    of the learning rate, each Adam moment tensor within 1/32 of its largest magnitude (a
    moment not restored is 10x or 1000x off)."""
    a, b = _rows(straight), _rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3]
    x, y = _without_volatile(a)[-1], _without_volatile(b)[-1]
    assert x.keys() == y.keys() and "moe/route_agreement" in x
    for k in x:
        assert y[k] == pytest.approx(x[k], rel=0.1 if k.startswith("quant/") else 5e-3, abs=1e-6), k
    wa, wb = _weights(straight), _weights(resumed)
    assert wa.keys() == wb.keys()
    for n in wa:
        off = (wa[n].float() - wb[n].float()).abs()
        assert (off <= torch.maximum(_ulp(wa[n]), _ulp(wb[n])) + LR / 10).all(), (n, off.max())
    ma, mb = _moments(straight), _moments(resumed)
    assert ma.keys() == mb.keys() and len(ma) == 2 * len(wa)
    for k in ma:
        assert (ma[k].float() - mb[k].float()).abs().max() <= ma[k].float().abs().max() / 32, k


def _ulp(w: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each element of ``w``."""
    return torch.exp2(torch.floor(torch.log2(w.float().abs().clamp_min(2.0 ** -126))) - 7)


def _moments(run: Path) -> dict[str, torch.Tensor]:
    """The Adam moments of the run's last checkpoint by ``name/exp_avg`` and ``name/exp_avg_sq``,
    whole: a sharded learner's from its ``learner/`` files, a whole one's from ``state.pt``
    (its optimizer states numbered in the order of its weights)."""
    path = ckpt.latest_checkpoint(run)
    learner = ckpt.load_checkpoint(path)["learner"]
    if learner.get("format") == SHARDED_FORMAT:
        found = ckpt.read_whole(path / "learner", ("optim/",))
        return {k.removeprefix("optim/"): v for k, v in found.items() if k.endswith(("/exp_avg", "/exp_avg_sq"))}
    states, names = learner["optimizer"]["state"], list(learner["model"])
    assert sorted(states) == list(range(len(names)))
    return {f"{n}/{k}": states[i][k] for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq")}


def _weights_at(run: Path, step: str) -> dict[str, torch.Tensor]:
    path = ckpt.checkpoint_dir(run) / step
    return ckpt.policy_weights(path, ckpt.load_checkpoint(path))


# ---------------------------------------------------------------- data-parallel rollouts

def _rollouts(out: Path, ranks: int, *flags: str) -> list[dict]:
    """This file's ``__main__`` on ``ranks`` gloo ranks: each step's rollouts over every rank."""
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={_port()}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, str(Path(__file__)), str(out), *RUN, *MOE_W4, "--trainer.steps=2", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / "rollouts.pt", weights_only=False)


def test_the_moe_engines_data_parallel_rollouts_are_one_processs(tmp_path):
    """Each rank's engine samples its share of the step's prompts (w4a16 experts, routes
    recorded), each prompt's samples seeded by its place in the step: over 2 ranks, with the
    learner whole on each or sharded, each step's rollouts are one process's in the step's
    order: the same tokens, the same recorded expert routes, the same rewards, and the
    sampler's log-probs to float32 rounding (the engines decode batches of other sizes). Step
    2 samples from the weights each run published after step 1."""
    one = _rollouts(tmp_path / "one", 1)
    assert len(one) == 2 and len(one[0]["tokens"]) == 6 * 4  # prompts x rollout.n
    assert all(r is not None and r.shape[1:] == (2, 2) for r in one[0]["routes"])  # 2 MoE layers x top-2
    assert one[0]["tokens"] != one[1]["tokens"]
    for name, flags in (("two", []), ("two_sharded", SHARDED)):
        two = _rollouts(tmp_path / name, 2, *flags)
        for step, (a, b) in enumerate(zip(one, two, strict=True), start=1):
            assert a["prompts"] == b["prompts"] and a["tokens"] == b["tokens"], (name, step)
            assert all(np.array_equal(x, y) for x, y in zip(a["routes"], b["routes"], strict=True)), (name, step)
            assert torch.equal(a["rewards"], b["rewards"]), (name, step)
            for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
                assert np.allclose(x, y, rtol=1e-5, atol=1e-5), (name, step)


if __name__ == "__main__":  # one rank of the rollout test above (under torchrun, or alone)
    import quarl.distributed
    from quarl.config import load_run_config
    from quarl.trainer.loop import Trainer
    from quarl.trainer.ranks import union_of_ranks

    out, flags = Path(sys.argv[1]), sys.argv[2:]
    trainer = Trainer(load_run_config(None, [*flags, f"--trainer.run_dir={out / 'run'}"]))
    seen: list[dict] = []
    collect = trainer.collector.collect

    def recorded(*args, **kwargs):
        rollout, preempted = collect(*args, **kwargs)
        union = union_of_ranks(trainer.dist, rollout, routes=True)  # (a collective: every rank)
        seen.append({"prompts": union.prompts, "tokens": [c.token_ids for c in union.completions],
                     "logprobs": [np.asarray(c.logprobs) for c in union.completions],
                     "routes": [c.routes for c in union.completions], "rewards": union.rewards})
        return rollout, preempted

    trainer.collector.collect = recorded
    trainer.run()
    if trainer.dist.main:
        torch.save(seen, out / "rollouts.pt")
    quarl.distributed.leave(0)
