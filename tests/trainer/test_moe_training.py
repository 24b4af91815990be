"""Training an MoE model (moe-tiny: 3 layers, 2 of them sparse with top-2 of 8 experts) end to
end: the engine's routes replayed by the learner (``rollout.routing_replay=r3``), the route
agreement and expert load metrics, route flips counted by hand, aligned low-bit modes, exact
resume, and 2 gloo ranks against one process."""

from __future__ import annotations

import json

import pytest
import torch

from quarl.config import load_run_config
from quarl.distributed import Dist
from quarl.model.moe import SparseMoeBlock, moe_routing, stacked_routes
from quarl.trainer.loop import Trainer
from quarl.trainer.scoring import batch_with_advantages
from quarl.trainer.stages import StageClock
from quarl.trainer.update import update_policy, update_settings
from tests.trainer.test_train_e2e import TINY, _checkpoint_weights

MOE = [*(a for a in TINY if not a.startswith("--model.builtin")), "--model.builtin=moe-tiny",
       "--trainer.sft_warmup_steps=0"]
R3 = "--rollout.routing_replay=r3"
VOLATILE = ("time/", "wall", "perf/eval_s", "perf/setup_s", "rollout/tokens_per_s", "memory/", "perf/learner_tflops",
            "perf/learner_mfu", "perf/compiles", "perf/compile_s", "perf/gc_")


def _train(run_dir, *overrides, steps=2, resume=False):
    cfg = load_run_config(None, MOE + [f"--trainer.run_dir={run_dir}", f"--trainer.steps={steps}", *overrides])
    trainer = Trainer(cfg, resume=resume)
    trainer.run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def _check_replayed(rows, noreplay: bool = True) -> None:
    for r in rows:
        assert r["mismatch/kl_k3"] < 1e-9, r["step"]
        assert ("mismatch/kl_k3_noreplay" in r) == noreplay
        if noreplay:
            assert r["mismatch/kl_k3_noreplay"] < 1e-9
        # float32 on the CPU: the learner routes every token as the engine did
        assert r["moe/route_agreement"] == r["moe/route_agreement_l0"] == r["moe/route_agreement_l2"] == 1.0
        assert "moe/route_agreement_l1" not in r  # (layer 1 is dense)
        assert 1 / 8 <= r["moe/expert_load_max"] <= 1 / 2  # top-2 of 8


def test_r3_replays_the_engines_routes_at_the_dense_mismatch_level(tmp_path):
    trainer, rows = _train(tmp_path, "--quant.mode=bf16", R3)
    assert trainer.learner.routing_replay and trainer.engine.records_routes
    assert len(rows) == 2
    _check_replayed(rows)


def test_without_r3_the_route_agreement_is_measured_too(tmp_path):
    trainer, rows = _train(tmp_path, "--quant.mode=bf16")
    assert not trainer.learner.routing_replay and trainer.engine.records_routes  # (to count the flips)
    _check_replayed(rows, noreplay=False)


@pytest.mark.parametrize("extra", [
    ["--algo.kl_coef=0.1", "--trainer.activation_checkpointing=true", "--trainer.ppo_epochs=2",
     "--trainer.mini_batches=2", "--algo.loss=ppo", "--trainer.token_budget=100"],
    ["--trainer.dynamic_sampling=true", "--algo.correction=icepop", "--algo.advantage=gae", "--algo.loss=ppo"],
], ids=["ref-checkpointing-minibatches", "dapo-icepop-critic"])
def test_r3_through_the_update_variants(tmp_path, extra):
    """The old-logp pass, the reference model, several micro- and mini-batches, activation
    checkpointing (the backward recomputes inside the replay), DAPO's refills, a correction that
    removes tokens, a critic: replay keeps every forward on the engine's routes."""
    _, rows = _train(tmp_path, "--quant.mode=bf16", R3, *extra)
    _check_replayed(rows)
    if "--algo.kl_coef=0.1" in extra:
        assert rows[-1]["loss/kl"] >= 0 and rows[-1]["perf/micro_batches"] > 1


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8"])
def test_aligned_modes_with_r3_add_no_mismatch(tmp_path, scheme):
    """aligned mode quantizes the experts in the engine and the learner alike (quarl.quant.experts):
    with the engine's routes replayed the learner's log-probs are the engine's."""
    trainer, rows = _train(tmp_path, "--quant.mode=aligned", f"--quant.scheme={scheme}", R3)
    from quarl.quant.experts import QATExperts, QuantExperts

    assert any(isinstance(m, QuantExperts) for m in trainer.engine.model.modules())
    assert any(isinstance(m, QATExperts) for m in trainer.learner.model.modules())
    _check_replayed(rows)


def _nudged_step(tmp_path, replay: bool):
    """One step's update on a rollout of the engine after the learner's routers moved (the
    engine keeps the weights it sampled with): its metrics and the agreement counted by hand."""
    cfg = load_run_config(None, MOE + [f"--trainer.run_dir={tmp_path}", "--quant.mode=bf16", "--trainer.steps=1",
                                       *([R3] if replay else [])])
    trainer = Trainer(cfg)
    rollout, _ = trainer.collector.collect(0, StageClock(torch.device("cpu")))
    batch = batch_with_advantages(rollout, cfg.algo, cfg.rollout.n, cfg.trainer.overlong_filter)
    model = trainer.learner.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                w = layer.mlp.gate.weight
                w.add_(0.3 * w.abs().mean() * torch.randn(w.shape, generator=gen))
        with moe_routing(model) as own:
            model(batch.input_ids, batch.attention_mask)
    mine = stacked_routes(own, trainer.learner.moe_layers).view(*batch.routes.shape).long()
    engine = batch.routes.long()
    known = (engine >= 0).all(-1)
    same = (mine.sort(-1).values == engine.sort(-1).values).all(-1) & known
    by_hand = {layer: float(same[..., j].sum()) / float(known[..., j].sum()) for j, layer in enumerate([0, 2])}
    by_hand["all"] = float(same.sum()) / float(known.sum())
    load = torch.stack([torch.bincount(engine[..., j, :][known[..., j]].reshape(-1), minlength=8)
                        for j in range(2)]).double()
    by_hand["load"] = float((load.max(-1).values / (known.sum((0, 1)) * 2)).max())
    result, _ = update_policy(batch, trainer.learner, cfg.algo, update_settings(cfg), Dist())
    trainer.rewards.close()
    return result.mismatch, by_hand


@pytest.mark.parametrize("replay", [False, True], ids=["off", "r3"])
def test_route_flips_are_counted_as_by_hand(tmp_path, replay):
    """The learner's routers moved away from the engine's: the agreement is the share of the
    engine's (token, layer) routes the learner's router picks itself (a hand count of a padded
    forward), below 1; with r3 the update replays them, and the mismatch it measures falls far
    below the one of the pass without replay."""
    mismatch, by_hand = _nudged_step(tmp_path, replay)
    assert 0 < by_hand["all"] < 1
    assert mismatch["moe/route_agreement"] == pytest.approx(by_hand["all"], abs=1e-12)
    for layer in (0, 2):
        assert mismatch[f"moe/route_agreement_l{layer}"] == pytest.approx(by_hand[layer], abs=1e-12)
    assert mismatch["moe/expert_load_max"] == pytest.approx(by_hand["load"], abs=1e-12)
    if replay:
        assert mismatch["mismatch/kl_k3"] < mismatch["mismatch/kl_k3_noreplay"] / 2
    else:
        assert "mismatch/kl_k3_noreplay" not in mismatch and mismatch["mismatch/kl_k3"] > 1e-9


def test_an_moe_run_with_r3_resumes_exactly(tmp_path):
    """3 steps straight == 2 steps, then --resume for 1 more (metrics and weights, bit for bit):
    the routes are part of no checkpoint, each step records its own."""
    _, straight = _train(tmp_path / "a", "--quant.mode=bf16", R3, "--trainer.save_every=2", steps=3)
    _train(tmp_path / "b", "--quant.mode=bf16", R3, "--trainer.save_every=2", steps=2)
    _, rows = _train(tmp_path / "b", "--quant.mode=bf16", R3, "--trainer.save_every=2", steps=3, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows] == \
        [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in straight]
    assert "moe/route_agreement" in rows[-1] and "mismatch/kl_k3_noreplay" in rows[-1]
    wa, wb = _checkpoint_weights(tmp_path / "a"), _checkpoint_weights(tmp_path / "b")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("mode", [["--quant.mode=bf16"],
                                  ["--quant.mode=aligned", "--quant.scheme=w4a16", "--trainer.shard_learner=true"]],
                         ids=["bf16", "aligned-w4a16-sharded"])
def test_two_gloo_ranks_train_an_moe_model_as_one_process(tmp_path, mode):
    """Each rank's engine records its rollouts' routes and its learner replays them: the two
    ranks' steps (route agreement counts summed over the ranks) are the one process's; with
    the learner sharded (FSDP2: the stacked experts split by rows like every other weight) and
    aligned low-bit experts too."""
    from tests.trainer.test_data_parallel import _assert_same_steps, _rows
    from tests.trainer.test_data_parallel import _train as launch

    moe = ["--model.builtin=moe-tiny", *mode, R3, "--trainer.steps=2"]
    for name, ranks in (("one", 1), ("two", 2)):
        res = launch(tmp_path / name, ranks, *moe)
        assert res.returncode == 0, res.stderr[-4000:]
    _assert_same_steps(tmp_path / "one", tmp_path / "two", [1, 2])
    last = _rows(tmp_path / "two")[-1]
    assert last["moe/route_agreement"] == 1.0 and last["mismatch/kl_k3_noreplay"] < 1e-9
