"""`quarl train` under `torchrun` on 2 gloo ranks against one process: the same steps, the same
metrics and weights; resume across world sizes; a world size that cannot split the prompts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quarl.trainer import checkpoint as ckpt
from tests.trainer.test_train_e2e import TINY

ROOT = Path(__file__).resolve().parents[2]
RUN = [*TINY, "--trainer.sft_warmup_steps=0", "--trainer.eval_every=2"]
# wall-clock and per-rank values (each rank's own timings, memory and engine check; preemptions depend
# on how many sequences one engine holds at once)
VOLATILE = ("time/", "wall", "perf/eval_s", "perf/setup_s", "rollout/tokens_per_s", "memory/", "perf/learner_tflops",
            "perf/learner_mfu", "perf/compiles",
            "perf/compile_s", "perf/gc_", "mismatch/engine_check", "rollout/preemptions",
            "perf/micro_batch", "perf/padding_frac")  # (the packing of rank 0's own rows)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(run_dir: Path, ranks: int, *args: str) -> subprocess.CompletedProcess:
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={_port()}"]
    cmd = [*launch, "-m", "quarl", "train", "--quiet", *RUN, f"--trainer.run_dir={run_dir}", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    path = ckpt.latest_checkpoint(run_dir)
    return ckpt.policy_weights(path, ckpt.load_checkpoint(path))


def _assert_same_steps(a: Path, b: Path, steps: list[int]) -> None:
    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == steps
    for x, y in zip(ra, rb):
        keys = {k for k in x if not k.startswith(VOLATILE)}
        assert keys == {k for k in y if not k.startswith(VOLATILE)} and "mismatch/kl_k3" in keys
        for k in keys:  # float32 sums in another order: the ranks' shares are smaller batches
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["step"], k)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for n in wa:  # Adam may step a weight whose gradient is ~0 the other way: 2 lr apart at most
        off = (wa[n] - wb[n]).abs()
        assert (off > 1e-5).float().mean() < 5e-3 and off.max() <= 4e-3, n


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    done = {}
    for name, ranks, args in (("one", 1, ["--trainer.steps=2"]), ("two", 2, ["--trainer.steps=2"])):
        res = _train(root / name, ranks, *args)
        assert res.returncode == 0, res.stderr[-4000:]
        done[name] = (root / name, res)
    return root, done


def test_two_ranks_train_the_steps_of_one_process(runs):
    """Each rank samples half of each step's prompts (seeded by the prompt's place in the step),
    the learner sums over the ranks, metrics cover every rank's rollouts, eval included:
    metrics.jsonl and the checkpoint equal the one process's; rank 0 alone printed."""
    root, done = runs
    _assert_same_steps(done["one"][0], done["two"][0], [1, 2])
    assert "eval/acc" in _rows(done["two"][0])[-1]
    # the wait for the slowest rank's rollout is its own stage (one process has none)
    assert _rows(done["two"][0])[-1]["time/rank_wait"] >= 0 and "time/rank_wait" not in _rows(done["one"][0])[-1]
    out = done["two"][1].stdout
    assert out.count("finished 2 steps") == 1, out


def test_a_two_rank_run_resumes_on_one_rank_and_on_two(runs):
    """The checkpoint holds no per-rank state: step 3 of the two-rank run resumed on one rank,
    and on two, are step 3 of the one-process run resumed."""
    root, done = runs
    for name, ranks in (("resumed_on_one", 1), ("resumed_on_two", 2)):
        import shutil

        shutil.copytree(done["two"][0], root / name)
        res = _train(root / name, ranks, "--resume", "--trainer.steps=3")
        assert res.returncode == 0, res.stderr[-4000:]
    for name in ("resumed_on_one", "resumed_on_two"):
        _assert_same_steps(_one_more_step(root, done), root / name, [1, 2, 3])


def _one_more_step(root: Path, done: dict) -> Path:
    """The one-process run resumed for a third step (made once)."""
    import shutil

    more = root / "one_more"
    if not more.exists():
        shutil.copytree(done["one"][0], more)
        res = _train(more, 1, "--resume", "--trainer.steps=3")
        assert res.returncode == 0, res.stderr[-4000:]
    return more


def test_a_sharded_learner_trains_as_one_process_and_resumes_sharded_or_not(runs):
    """trainer.shard_learner=true (FSDP2, aligned w4a16 here: the engines get the low-bit
    weights quantized shard by shard and gathered packed): two ranks train the one process's
    steps; each rank writes its shards of the checkpoint (torch.distributed.checkpoint), and
    step 3 resumed from it on one unsharded rank and on two sharded ones is the one process's
    step 3; so is the one process's checkpoint resumed on two sharded ranks."""
    import shutil

    root, done = runs
    res = _train(root / "sharded", 2, "--trainer.steps=2", "--trainer.shard_learner=true")
    assert res.returncode == 0, res.stderr[-4000:]
    _assert_same_steps(done["one"][0], root / "sharded", [1, 2])
    assert len(list((ckpt.latest_checkpoint(root / "sharded") / "learner").glob("*.distcp"))) == 2  # one per rank
    from quarl.export.hf import read_policy  # (quarl export and eval read it whole)

    policy = read_policy(ckpt.latest_checkpoint(root / "sharded"))
    assert policy.state.keys() == _weights(root / "sharded").keys() and policy.step == 2
    # (and the one process's checkpoint, whole tensors in state.pt, resumed sharded)
    for name, ranks, run in (("sharded_on_one", 1, "sharded"), ("sharded_on_two", 2, "sharded"),
                             ("one_sharded", 2, "one")):
        shutil.copytree(root / run, root / name)
        res = _train(root / name, ranks, "--resume", "--trainer.steps=3", "--trainer.shard_learner=true")
        assert res.returncode == 0, res.stderr[-4000:]
        _assert_same_steps(_one_more_step(root, done), root / name, [1, 2, 3])


def test_a_sharded_checkpoint_resumes_on_three_ranks_with_uneven_shards(tmp_path):
    """Two sharded ranks' checkpoint resumed on three (rows no longer split evenly: FSDP pads
    the last shard) gives the step 3 and the weights of the same checkpoint resumed in one
    process."""
    import shutil

    six = ["--trainer.prompts_per_step=6", "--quant.mode=aligned", "--quant.scheme=w4a16"]
    res = _train(tmp_path / "two", 2, *six, "--trainer.steps=2", "--trainer.shard_learner=true")
    assert res.returncode == 0, res.stderr[-4000:]
    for name, ranks in (("on_three", 3), ("on_one", 1)):
        shutil.copytree(tmp_path / "two", tmp_path / name)
        res = _train(tmp_path / name, ranks, *six, "--resume", "--trainer.steps=3")
        assert res.returncode == 0, res.stderr[-4000:]
    _assert_same_steps(tmp_path / "on_one", tmp_path / "on_three", [1, 2, 3])


def test_a_sharded_lean_run_resumes_exactly_with_each_ranks_rounding_bits(tmp_path):
    """bf16 weights and moments stepped by stochastic rounding on 2 sharded ranks: each rank
    rounds its own shards with its own generator and the whole tensors (the norms) with one
    they share, and the checkpoint keeps every rank's states, so 1 step + --resume for 1 more
    equals 2 steps straight, bit for bit."""
    lean = ["--model.dtype=bfloat16", "--optim.fp32_master=false", "--optim.state_dtype=bfloat16",
            "--trainer.shard_learner=true", "--optim.lr=1e-4", "--trainer.eval_every=0"]
    for name, steps, more in (("straight", 2, []), ("resumed", 1, []), ("resumed", 2, ["--resume"])):
        res = _train(tmp_path / name, 2, *lean, f"--trainer.steps={steps}", *more)
        assert res.returncode == 0, res.stderr[-4000:]
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in b]
    wa, wb = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[n], wb[n]) for n in wa)
    rest = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "resumed"))["learner"]
    one, two = rest["rounding"]  # every rank's generators: the shared one alike, the shards' not
    assert torch.equal(one["cpu"], two["cpu"]) and not torch.equal(one["cpu/shard"], two["cpu/shard"])


def test_two_nodes_of_one_rank_train_as_two_ranks_of_one_node(runs, tmp_path):
    """Several nodes: one torchrun per node (``--nnodes=2 --node_rank=i``, one rank each, so
    both ranks are LOCAL_RANK 0 of their node) train the steps of two ranks on one node and
    write one checkpoint, sharded learner included (the run directory is shared, as it must
    be across nodes)."""
    root, done = runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for name, more in (("nodes", []), ("nodes_sharded", ["--trainer.shard_learner=true"])):
        port = _port()
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={i}", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "quarl", "train", "--quiet", *RUN,
             f"--trainer.run_dir={tmp_path / name}", "--trainer.steps=2", *more],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
        outs = [p.communicate(timeout=600) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
        assert outs[0][0].count("finished 2 steps") == 1 and "finished" not in outs[1][0]  # (global rank 0 alone)
        _assert_same_steps(done["two"][0], tmp_path / name, [1, 2])


def test_rank_zero_warm_starts_the_base_and_the_others_load_it(tmp_path):
    """With a supervised warm-start rank 0 trains and caches the base before the other ranks
    build theirs (they load the cache): the two ranks' step is the one process's."""
    warm = ["--trainer.sft_warmup_steps=5", "--trainer.steps=1"]
    for name, ranks in (("one", 1), ("two", 2)):
        res = _train(tmp_path / name, ranks, *warm)
        assert res.returncode == 0, res.stderr[-4000:]
    assert any((tmp_path / "two" / "warmstart").iterdir())
    _assert_same_steps(tmp_path / "one", tmp_path / "two", [1])


def test_a_world_size_that_cannot_split_the_prompts_is_refused(tmp_path):
    res = _train(tmp_path / "bad", 2, "--trainer.prompts_per_step=3", "--trainer.steps=1")
    assert res.returncode != 0
    assert "3 prompts per step cannot be split evenly over 2 ranks: set trainer.prompts_per_step to a multiple " \
           "of 2" in res.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_a_rank_that_dies_stops_the_run_and_leaves_the_last_checkpoint(tmp_path):
    """Rank 1 exits mid-step 2: the launch ends promptly with an error instead of hanging, the
    checkpoint of step 1 is intact, and the run resumes from it on one rank."""
    import time

    run = tmp_path / "crash"
    start = time.monotonic()
    dies = "--data.reward=tests.trainer.reward_fns:rank_one_dies_in_step_two"  # (never on a lone rank 0)
    res = _train(run, 2, "--trainer.steps=3", "--trainer.save_every=1", dies)
    assert res.returncode != 0 and time.monotonic() - start < 240
    assert [r["step"] for r in _rows(run)] == [1]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run))["step"] == 1
    res = _train(run, 1, "--resume", "--trainer.steps=2", "--trainer.save_every=1", dies)
    assert res.returncode == 0, res.stderr[-4000:]
    assert [r["step"] for r in _rows(run)] == [1, 2]


def test_gae_whitens_over_every_rank(tmp_path):
    """algo.advantage=gae: the critic's gradients are summed like the policy's and the GAE
    advantages are whitened with the mean and std of every rank's response tokens: two ranks
    train the steps of one process, also with the learner (critic included) sharded."""
    gae = ["--algo.advantage=gae", "--algo.loss=ppo", "--trainer.steps=2"]
    for name, ranks, more in (("one", 1, []), ("two", 2, []), ("sharded", 2, ["--trainer.shard_learner=true"])):
        res = _train(tmp_path / name, ranks, *gae, *more)
        assert res.returncode == 0, res.stderr[-4000:]
    for name in ("two", "sharded"):  # (sharded: the critic's trunk too)
        _assert_same_steps(tmp_path / "one", tmp_path / name, [1, 2])
        assert "loss/value" in _rows(tmp_path / name)[-1]


def test_dynamic_sampling_chooses_over_every_rank(tmp_path):
    """trainer.dynamic_sampling (DAPO): the groups whose rewards differ are chosen over every
    rank's groups, refills are sampled in shares, the kept groups are shared out again: two
    ranks train the steps of one process, the DAPO counts included."""
    dapo = ["--trainer.dynamic_sampling=true", "--trainer.steps=2"]
    for name, ranks in (("one", 1), ("two", 2)):
        res = _train(tmp_path / name, ranks, *dapo)
        assert res.returncode == 0, res.stderr[-4000:]
    _assert_same_steps(tmp_path / "one", tmp_path / "two", [1, 2])
    rows = _rows(tmp_path / "two")
    assert sum(r["dapo/dropped_groups"] for r in rows) > 0  # the choice mattered


@pytest.mark.parametrize("where", ["rank_one_disk_full_at_second_save", "rank_zero_disk_full_at_second_save"])
def test_a_checkpoint_part_that_cannot_be_written_fails_it_on_every_rank(tmp_path, where):
    """A sharded learner hits a full disk writing step 2's checkpoint, on rank 1 (its shards)
    or on rank 0 (state.pt, after the shards): every rank stops with the error, rank 0 names
    it and the intact checkpoint of step 1, no temporary directory is left behind, and the
    run resumes from step 1."""
    run = tmp_path / "full"
    disk = f"--data.reward=tests.trainer.reward_fns:{where}"
    res = _train(run, 2, "--trainer.steps=2", "--trainer.save_every=1", "--trainer.shard_learner=true", disk)
    assert res.returncode != 0
    assert "could not write checkpoint" in res.stderr and "No space left on device" in res.stderr, res.stderr[-3000:]
    assert "the checkpoint of step 1" in res.stderr and "is intact" in res.stderr
    assert [p.name for p in ckpt.checkpoint_dir(run).iterdir()] == ["step_000001"]
    # (the same flags: this process's first save is whole again)
    res = _train(run, 2, "--resume", "--trainer.steps=2", "--trainer.save_every=1", "--trainer.shard_learner=true",
                 disk)
    assert res.returncode == 0, res.stderr[-4000:]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run))["step"] == 2
