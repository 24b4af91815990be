"""Data-parallel ranks (``quarl.distributed``): 2 gloo processes under ``torchrun`` each update
on their half of a batch and end with the weights and metrics of one process on all of it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quarl.distributed import Dist

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8  # 4 prompts x 2 samples: 2 prompts per rank
MODES = ("fp32", "bf16-masters", "aligned-w4a16")


def test_share_splits_evenly_or_names_the_setting():
    assert [Dist(r, 4).share(12) for r in range(4)] == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert Dist().share(5) == range(5)
    with pytest.raises(ValueError, match=r"10 prompts per step cannot be split evenly over 4 ranks: set "
                                         r"trainer.prompts_per_step to a multiple of 4"):
        Dist(1, 4).share(10)


def test_a_rank_takes_its_share_of_the_cpu_cores_unless_told_otherwise():
    """torchrun sets OMP_NUM_THREADS=1 when it is unset: each rank then gets cores // local
    ranks threads; any other value the user set stays."""
    from quarl.distributed import cpu_threads

    assert cpu_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"}, 64) == 16
    assert cpu_threads({"LOCAL_WORLD_SIZE": "3"}, 64) == 21
    assert cpu_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}, 4) == 1
    assert cpu_threads({"OMP_NUM_THREADS": "6", "LOCAL_WORLD_SIZE": "4"}, 64) is None


def test_one_process_collectives_are_the_identity():
    d = Dist()
    assert d.main and d.sum([1.5, 2.0]) == [1.5, 2.0] and d.max(3) == 3 and d.gather({"a": 1}) == [{"a": 1}]
    t = torch.ones(2)
    assert d.sum_tensor_(t) is t and torch.equal(t, torch.ones(2))


def test_buckets_cut_by_bytes_dtype_and_size_hand_computed():
    from quarl.distributed import buckets

    f = [torch.zeros(n) for n in (4, 4, 8, 2)]  # 16, 16, 32, 8 bytes
    h = torch.zeros(4, dtype=torch.float16)  # 8 bytes, another dtype
    big = torch.zeros(10)  # 40 bytes: a bucket of its own at a 32-byte limit
    got = buckets([f[0], f[1], h, f[2], big, f[3]], 32)
    assert [[id(t) for t in b] for b in got] == [[id(f[0]), id(f[1])], [id(h)], [id(f[2])], [id(big)], [id(f[3])]]
    assert buckets([], 32) == []


def _batch():
    from quarl.learner.batch import build_batch

    g = torch.Generator().manual_seed(5)
    prompts, responses, lps = [], [], []
    for i in range(ROWS):
        prompts.append(torch.randint(3, 120, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist())
        r = torch.randint(3, 120, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        responses.append(r)
        lps.append((-torch.rand(len(r), generator=g) * 4).tolist())
    adv = torch.randn(ROWS, generator=g)
    return build_batch(prompts, responses, lps, [0.0] * ROWS, adv)


def _learner(mode: str, dist: Dist, shard: bool = False):
    from quarl.learner.learner import Learner
    from quarl.model.presets import build_random_model
    from quarl.quant import quantize_model

    from dataclasses import replace

    from quarl.model.presets import preset_config

    dtype = torch.bfloat16 if mode.endswith(("bf16-masters", "bf16-lean")) else torch.float32
    cfg = replace(preset_config("tiny"), tie_word_embeddings=mode.startswith("tied-"))  # (tied: one weight, two uses)
    model = build_random_model(cfg, seed=3, dtype=dtype, std=0.1)
    if mode.startswith("aligned-w4a16"):
        quantize_model(model, "w4a16")
    if mode == "lora-w4a16":  # adapters (random, so both A and B get gradients) on a frozen w4a16 base
        from quarl.model.lora import add_lora, lora_modules
        from quarl.quant import QuantLinear

        quantize_model(model, "w4a16", QuantLinear)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.learner_path = True
        add_lora(model, rank=4, alpha=8)
        g = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for _, _, ad in lora_modules(model):
                ad.A.copy_(0.2 * torch.randn(ad.A.shape, generator=g))
                ad.B.copy_(0.2 * torch.randn(ad.B.shape, generator=g))
    lean = {"fp32_master": False, "state_dtype": torch.bfloat16} if mode == "bf16-lean" else {}
    return Learner(model, lr=1e-2, dist=dist, shard=shard, activation_checkpointing=mode.endswith("-ac"), **lean)


def _update(mode: str, dist: Dist, rows: range, loss: str, agg: str | None, shard: bool = False):
    """Two updates on ``rows`` of the batch, one row per micro-batch (a few metrics, such as
    the largest ratio, are means of per-micro-batch values: the same micro-batches on one
    process and on the ranks make them comparable); the final weights and both updates'
    metrics."""
    from quarl.learner.learner import UpdateSettings

    learner = _learner(mode, dist, shard)
    batch = _batch().select(torch.tensor(list(rows)))
    hp = {} if agg is None else {"agg": agg}
    metrics = [learner.update(batch, UpdateSettings(loss_type=loss, loss_hparams=hp, token_budget=1))]
    batch.old_logp = learner.last_logp.clone()
    metrics.append(learner.update(batch, UpdateSettings(loss_type=loss, loss_hparams=hp, token_budget=1)))
    sd = learner.state_dict()  # (whole tensors, also from a sharded learner)
    weights = {n: t.float().clone() for n, t in sd["model"].items()}
    moments = {i: st["exp_avg"].float().clone() for i, st in sd["optimizer"]["state"].items()}
    return weights, moments, metrics, _held(learner)


def _held(learner) -> float:
    """The fraction of the weights and Adam moments (norms aside) this process holds."""
    from quarl.learner.sharded import is_sharded

    def local(t):
        return t.to_local().numel() if is_sharded(t) else t.numel()

    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    stepped = dict(zip(names, (p for g in learner.optimizer.param_groups for p in g["params"])))  # (in this order)
    learner.policy.resharded()
    params = [p for n, p in learner.model.named_parameters() if "norm" not in n]
    moments = [learner.optimizer.state[stepped[n]]["exp_avg"] for n in names if "norm" not in n]
    return sum(local(t) for t in params + moments) / sum(t.numel() for t in params + moments)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(out: Path, *args: str) -> None:
    """This file's ``__main__`` as 2 gloo ranks under torchrun, with ``args``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", str(Path(__file__)), str(out), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]


@pytest.mark.parametrize("loss,agg", [("ppo", "token-mean"), ("tbpo", None), ("sapo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("mode", MODES)
def test_two_gloo_ranks_update_as_one_process_on_the_whole_batch(tmp_path, mode, loss, agg):
    """Each rank holds half of the rows; the learner's totals and gradients summed over the
    ranks make every rank's weights and metrics those of one process on all the rows
    (float32 tolerance), in fp32, bf16 with fp32 masters and aligned w4a16 (whose ranks sum
    their gradients in 8 KB buckets: some reduced where they lie)."""
    _run_ranks(tmp_path / "ranks", mode, loss, str(agg), "replicated")
    assert _assert_ranks_match_one_process(tmp_path / "ranks", mode, loss, agg) == [1.0, 1.0]


@pytest.mark.parametrize("mode,loss,agg", [*((m, "ppo", "token-mean") for m in MODES),
                                           *((m, "sapo", "seq-mean-token-sum-norm") for m in MODES),
                                           ("aligned-w4a16-ac", "ppo", "token-mean"), ("lora-w4a16", "ppo",
                                                                                       "token-mean"),
                                           ("tied-bf16-masters", "ppo", "token-mean"), ("bf16-lean", "ppo",
                                                                                        "token-mean")])
def test_a_sharded_learner_updates_as_one_process(tmp_path, mode, loss, agg):
    """FSDP2 (``shard=True``): each rank holds half of every decoder layer's weights and
    optimizer states; gathered back (:meth:`Learner.state_dict`), the weights, Adam moments
    and metrics are those of one unsharded process on all the rows, in fp32, bf16 with
    float32 masters (the sharded weights stored in float32, gathered in bf16), aligned w4a16
    (quantizing the gathered weights), aligned w4a16 with activation checkpointing (the
    backward's recomputation gathers again), LoRA adapters on a frozen w4a16 base, and tied
    embeddings (the root's one weight used twice), and bf16 weights and Adam moments stepped
    directly with stochastic rounding (each rank rounds its own shards: the same distribution,
    other draws, within bf16 tolerance). The embeddings and LM head are sharded too:
    each rank holds half of every weight but the norms."""
    _run_ranks(tmp_path / "ranks", mode, loss, str(agg), "sharded")
    assert _assert_ranks_match_one_process(tmp_path / "ranks", mode, loss, agg) == [0.5, 0.5]


def _assert_ranks_match_one_process(out: Path, mode: str, loss: str, agg: str | None) -> list[float]:
    """Checks each rank's results against one process; returns the fraction of the layers'
    weights and moments each rank held (:func:`_held`)."""
    ref_w, ref_adam, ref_m, _ = _update(mode, Dist(), range(ROWS), loss, agg)
    start = {n: p.detach().float() for n, p in _learner(mode, Dist()).model.named_parameters()}
    bf16 = mode.endswith(("bf16-masters",
                          "bf16-lean"))  # micro-batch gradients accumulate in bf16 before the fp32 masters
    rel = 5e-2 if bf16 else 1e-4
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert all(m["time/grad_sync"] > 0 for m in got["metrics"])  # (the ranks' own: not in one process's)
        for k in ref_m[0]:  # grad_norm among them: the norm of the summed gradients
            for a, b in zip(got["metrics"], ref_m):
                assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-6), (rank, k)
        # Adam's first moments are linear in the gradients: the ranks' sums are the one process's
        assert got["adam"].keys() == ref_adam.keys() and ref_adam
        for i, m in ref_adam.items():
            torch.testing.assert_close(got["adam"][i], m, rtol=rel, atol=rel * m.abs().max().item(),
                                       msg=lambda e: f"rank {rank} moment {i}: {e}")
        # the weights: equal but where a gradient near zero changed sign with the float32 sum
        # order (Adam then steps that element by -lr instead of +lr, 2e-2 apart)
        # (bf16-lean: the ranks' shards also round with other random bits than the one process:
        # an element whose exact value lies between two bf16 numbers may land on the other one)
        assert got["weights"].keys() == ref_w.keys()
        share = 6e-2 if mode == "bf16-lean" else 3e-2 if bf16 else 5e-3
        for n, w in ref_w.items():
            off = (got["weights"][n] - w).abs() > 1e-5 + rel * w.abs()
            assert off.float().mean() < share and (got["weights"][n] - w).abs().max() <= 4e-2 + 1e-6, (rank, n)
        assert any(not torch.equal(ref_w[n], start[n]) for n in ref_w)  # the updates did move the weights
    return [torch.load(out / f"rank{rank}.pt")["held"] for rank in range(2)]


if __name__ == "__main__":  # one rank of the test above, under torchrun
    import quarl.distributed
    from quarl.distributed import from_env

    out, mode, loss, agg, layout = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    if mode == "aligned-w4a16":  # many small buckets, and gradients reduced where they lie
        quarl.distributed.BUCKET_BYTES = 8192
    dist = from_env("cpu")
    weights, adam, metrics, held = _update(mode, dist, dist.share(ROWS, "rows"), loss,
                                           None if agg == "None" else agg, shard=layout == "sharded")
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": weights, "adam": adam, "metrics": metrics, "held": held}, out / f"rank{dist.rank}.pt")
    quarl.distributed.leave(0)  # (without the interpreter's teardown, where gloo has aborted finished ranks)
