"""The repository's experiment suites (``experiments/``): every spec loads and every run config
is valid and takes its base's sections; the MoE, long-response and two-bit suites hold the
runs their pages describe; and each of those three runs end to end at tiny scale on the CPU
through ``quarl suite run``."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from quarl.cli.main import main
from quarl.config import load_run_config
from quarl.config.typed import read_yaml
from quarl.experiments.suite import load_suite, plan_runs, run_config

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
DENSE_BASE = EXPERIMENTS / "base.yaml"
SUITES = sorted(p.parent.name for p in EXPERIMENTS.glob("*/suite.yaml"))

# run -> (quant.mode, quant.scheme (None: bf16), algo.loss, rollout.routing_replay)
REGIMES = {
    "moe": {
        "bf16-grpo": ("bf16", None, "ppo", "off"),
        "rollout-w4a16-grpo": ("rollout", "w4a16", "ppo", "off"),
        "rollout-w4a16-grpo-r3": ("rollout", "w4a16", "ppo", "r3"),
        "aligned-w4a16-tbpo": ("aligned", "w4a16", "tbpo", "off"),
        "aligned-w4a16-tbpo-r3": ("aligned", "w4a16", "tbpo", "r3"),
        "aligned-fp8-tbpo": ("aligned", "w8a8-fp8", "tbpo", "off"),
    },
    "long": {
        "bf16-grpo": ("bf16", None, "ppo", "off"),
        "rollout-w4a16-grpo": ("rollout", "w4a16", "ppo", "off"),
        "rollout-w4a16-tbpo": ("rollout", "w4a16", "tbpo", "off"),
        "aligned-w4a16-grpo": ("aligned", "w4a16", "ppo", "off"),
        "aligned-w4a16-tbpo": ("aligned", "w4a16", "tbpo", "off"),
    },
    "w2": {
        "bf16-grpo": ("bf16", None, "ppo", "off"),
        "rollout-w2a16-grpo": ("rollout", "w2a16", "ppo", "off"),
        "aligned-w2a16-grpo": ("aligned", "w2a16", "ppo", "off"),
        "aligned-w2a16-tbpo": ("aligned", "w2a16", "tbpo", "off"),
    },
}
# what every one of them must tabulate: held-out accuracy, mismatch by length quartile,
# error tokens, the loss's clipped and dropped shares
SHARED_COLUMNS = {"eval/acc", "eval/learner_exact", "reward/mean", "mismatch/kl_k3", "mismatch/kl_k3_q1",
                  "mismatch/kl_k3_q4", "errors/response_frac", "loss/clip_frac", "tbpo/drop_frac_pos",
                  "tbpo/drop_frac_neg"}


@pytest.mark.parametrize("suite_dir", SUITES)
def test_the_repository_suites_load_and_every_run_config_is_valid(suite_dir, tmp_path):
    suite = load_suite(EXPERIMENTS / suite_dir)
    # one base a suite: the dense base, or a recipe of the suite's own beside its suite.yaml
    assert suite.base in (DENSE_BASE.resolve(), (EXPERIMENTS / suite_dir / "base.yaml").resolve())
    assert len(suite.seeds) >= 3
    recipe = read_yaml(suite.base)
    plan = plan_runs(suite, tmp_path, tmp_path / "base")
    assert len(plan) == len(suite.runs) * len(suite.seeds)
    for r in plan:
        cfg = load_run_config(str(r.config_file))
        mode = cfg.quant.mode.value
        # bf16 runs are named so; a quantized run names its mode and its scheme, or its suite's title does
        assert (mode == "bf16") == r.name.startswith("bf16"), r.name
        if mode != "bf16":
            assert mode in r.name or mode in suite.title.lower(), r.name
            assert cfg.quant.scheme.name.removeprefix("w8a8-") in r.name + suite.title, r.name
        assert cfg.model.path == str(tmp_path / "base") and cfg.trainer.sft_warmup_steps == 0
        # the base recipe's sections
        assert cfg.model.builtin == recipe["model"]["builtin"]
        assert (cfg.data.task, cfg.data.difficulty) == (recipe["data"]["task"], recipe["data"]["difficulty"])
        assert cfg.rollout.max_new_tokens == recipe["rollout"]["max_new_tokens"]


@pytest.mark.parametrize("suite_dir", sorted(REGIMES))
def test_the_regime_suites_hold_their_runs(suite_dir, tmp_path):
    suite = load_suite(EXPERIMENTS / suite_dir)
    assert set(suite.runs) == set(REGIMES[suite_dir]) and suite.baseline == "bf16-grpo"
    assert suite.seeds == [0, 1, 2]
    for r in plan_runs(suite, tmp_path, tmp_path / "base"):
        cfg = load_run_config(str(r.config_file))
        mode, scheme, loss, replay = REGIMES[suite_dir][r.name]
        assert cfg.quant.mode.value == mode, r.name
        if scheme is not None:
            assert cfg.quant.scheme.name == scheme, r.name
        assert (cfg.algo.loss, cfg.rollout.routing_replay, cfg.algo.advantage) == (loss, replay, "grpo"), r.name
        assert cfg.trainer.steps >= 150 and cfg.trainer.eval_before_train, r.name
    columns = {c.metric for c in suite.table}
    assert SHARED_COLUMNS <= columns
    if suite_dir == "moe":
        assert {"moe/route_agreement", "mismatch/kl_k3_noreplay", "moe/expert_load_max"} <= columns


def _trainer(recipe: dict, *drop: str) -> dict:
    return {k: v for k, v in recipe["trainer"].items() if k not in drop}


def test_the_moe_base_is_the_dense_recipe_on_the_moe_shape():
    from quarl.model.presets import preset_config

    dense, moe = read_yaml(DENSE_BASE), read_yaml(EXPERIMENTS / "moe" / "base.yaml")
    assert moe["model"] == {**dense["model"], "builtin": "moe-100m"} and preset_config("moe-100m").is_moe
    assert moe["data"] == dense["data"] and moe["rollout"] == dense["rollout"]
    # the same warm start (rate, batch, stop at the same held-out exact share), a higher cap
    assert _trainer(moe, "sft_warmup_steps") == _trainer(dense, "sft_warmup_steps")
    assert moe["trainer"]["sft_warmup_steps"] >= dense["trainer"]["sft_warmup_steps"]


def test_the_long_base_is_the_dense_recipe_on_long_chains():
    from quarl.tasks import CycleTask

    dense, long = read_yaml(DENSE_BASE), read_yaml(EXPERIMENTS / "long" / "base.yaml")
    assert long["model"] == dense["model"]
    assert {k: v for k, v in long["data"].items() if k not in ("task", "difficulty")} == \
        {k: v for k, v in dense["data"].items() if k not in ("task", "difficulty")}
    assert _trainer(long, "sft_warmup_steps") == _trainer(dense, "sft_warmup_steps")
    task = CycleTask(difficulty=long["data"]["difficulty"], num_train=500, num_eval=0)
    lengths = [len(e.solution) + 1 for e in task.train_examples()]  # built-in tokens, with eos
    assert max(lengths) < long["rollout"]["max_new_tokens"] == 2048 and min(lengths) >= 700
    # every sample of a step fits the engine's KV cache at once (16-token blocks)
    suite = load_suite(EXPERIMENTS / "long")
    cfg = run_config(suite, "bf16-grpo", 0, Path("/tmp/r"), None)
    blocks = cfg["rollout"]["engine"]["num_kv_blocks"]
    per_step = cfg["trainer"]["prompts_per_step"] * cfg["rollout"]["n"]
    assert blocks * 16 >= per_step * (long["data"]["max_prompt_len"] + long["rollout"]["max_new_tokens"])


def test_the_w2_bf16_run_is_stability_longs(tmp_path):
    """Run beside stability-long, the two-bit suite copies its bf16 GRPO runs (the same config
    from the same base) instead of training them again."""
    w2, long = load_suite(EXPERIMENTS / "w2"), load_suite(EXPERIMENTS / "stability-long")
    assert w2.base == long.base
    for seed in w2.seeds:
        assert (run_config(w2, "bf16-grpo", seed, tmp_path, tmp_path / "base")
                == run_config(long, "bf16-grpo", seed, tmp_path, tmp_path / "base"))


# ---------------------------------------------------------------------- end to end, tiny, on the CPU

TINY = ["--model.dtype=float32", "--data.num_train=64", "--data.num_eval=4", "--trainer.sft_warmup_steps=3",
        "--trainer.sft_target_exact=0", "--trainer.steps=2", "--trainer.prompts_per_step=2", "--rollout.n=2",
        "--rollout.max_new_tokens=24", "--trainer.eval_every=1"]


# the long suite at difficulty 2: worked solutions of tens of tokens, not ~1.3k (the CPU run
# checks the plumbing; its task's lengths are checked in tests/tasks/test_cycles.py)
SHRINK = {"long": ["--data.difficulty=2"]}


@pytest.mark.parametrize("suite_dir, model", [("moe", "moe-tiny"), ("long", "tiny"), ("w2", "tiny")])
def test_a_regime_suite_runs_end_to_end_at_tiny_scale(suite_dir, model, tmp_path):
    """The suite's own files through ``quarl suite run`` (seed 0, every run, 2 at once), the
    model and lengths shrunk by flags: every run trains, and the page tabulates each."""
    work, out = tmp_path / "work", tmp_path / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["suite", "run", str(EXPERIMENTS / suite_dir), "--work", str(work), "--out", str(out),
                     "--seeds", "0", "--parallel", "2", f"--model.builtin={model}", *TINY,
                     *SHRINK.get(suite_dir, [])])
    logs = {f.name: f.read_text()[-2000:] for f in (work / "logs").glob("*.log")}
    runs = REGIMES[suite_dir]
    assert code == 0 and f"{len(runs)} of {len(runs)} runs complete" in buf.getvalue(), (buf.getvalue(), logs)
    recipe = read_yaml(EXPERIMENTS / suite_dir / "suite.yaml")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == [] and summary["missing"] == [] and summary["incomplete"] == []
    for name, (mode, _, loss, replay) in runs.items():
        cfg = yaml.safe_load((out / "runs" / name / "seed0" / "config.yaml").read_text())
        assert (cfg["quant"]["mode"], cfg["model"]["builtin"]) == (mode, model)
        assert cfg["model"]["path"] == str(work / "base" / "warmstart")
        row = summary["runs"][name]
        for col in ("eval/acc (start)", "eval/acc (end)", "kl_k3", "error-token responses", "clipped"):
            assert row[col]["n"] == 1, (name, col)
        assert row["kl_k3"]["mean"] >= 0
        if suite_dir == "moe":  # the routing columns: agreement in every run, the replay's gap with r3 alone
            assert 0 < row["route agreement"]["mean"] <= 1 and 0 < row["busiest expert"]["mean"] <= 1
            assert row["kl_k3 without replay"]["n"] == (1 if replay == "r3" else 0), name
        if suite_dir == "long":
            assert cfg["data"]["task"] == "cycle" and row["length (last 5)"]["mean"] > 0
    page = (out / "README.md").read_text()
    assert page.startswith(f"# {recipe['title']}")
    for plot in recipe["plots"]:
        assert f"![{plot['title']}]" in page, plot["title"]

