"""``quarl bench train``'s parts on CPU: the per-mode run and its medians."""

from __future__ import annotations

from pathlib import Path

import pytest

from quarl.bench.train import MODES, Workload, median_metrics, run_mode, save_random_model, workload_overrides
from quarl.model.presets import preset_config


def test_medians_skip_the_first_step():
    rows = [{"time/step": 9.0, "mismatch/kl_k3": 1.0}, {"time/step": 1.0, "mismatch/kl_k3": None},
            {"time/step": 3.0, "mismatch/kl_k3": 2.0}, {"time/step": 2.0}]
    assert median_metrics(rows) == {"step_s": 2.0, "kl_k3": 2.0}
    # a workload whose step 2 compiles again (lora-7b): its warm-up of two steps is left out
    assert median_metrics(rows, warmup=2) == {"step_s": 2.5, "kl_k3": 2.0}
    assert median_metrics(rows[:1], warmup=2) == {"step_s": 9.0, "kl_k3": 1.0}


@pytest.mark.parametrize("mode,profile,stage", [("bf16", "kernels", "learner"), ("aligned-w4a16", "host", "learner"),
                                                ("aligned-w4a16", "host", "publish"),
                                                ("aligned-w4a16", None, "learner")])
def test_run_mode_on_a_saved_random_model(tmp_path, mode, profile, stage):
    w = Workload("tiny", prompts=2, n=2, gen=6, token_budget=256, steps=2)
    model_dir = save_random_model(w.shape, tmp_path / "model")
    rows, table = run_mode(mode, workload_overrides(w, model_dir) + MODES[mode], tmp_path / mode, profile, stage)
    if profile == "kernels":  # the last step's learner under the profiler: a table of its busiest ops
        assert table.startswith("bf16 learner: wall") and len(table.splitlines()) > 5
        assert "aten::" in table
    elif profile and stage == "learner":  # under cProfile: the learner's own functions by cumulative time
        assert table.startswith("aligned-w4a16 learner: host") and "learner.py" in table
        assert "linear.py" in table  # the aligned linears' forward shows up on the host
    elif profile:  # the publish: the quantizer and the engine's load under cProfile, not the learner
        assert table.startswith("aligned-w4a16 publish: host") and "weights.py" in table
        # (not the engine's load too: on a tiny model it takes ~1 ms among near-ties of the
        # table's top rows, which a busy machine reorders)
        assert "learner.py" not in table
    else:
        assert table == ""
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response/len_mean"] == 6 for r in rows)  # random weights: forced length
    # the learner's model FLOPs: 6 P T over forward + backward of every prompt + response token
    r = rows[1]
    assert r["perf/learner_tokens"] > 4 * 6
    want = 6 * preset_config("tiny").matmul_params * r["perf/learner_tokens"] / r["time/learner"] / 1e12
    assert r["perf/learner_tflops"] == pytest.approx(want, rel=1e-6)
    assert "perf/learner_mfu" not in r  # CPU: no measured matrix rate
    assert median_metrics(rows)["step_s"] == r["time/step"]


def test_profile_call_names_its_kinds():
    from quarl.bench.train import profile_call

    with pytest.raises(ValueError, match="kernels, host"):
        profile_call(lambda: None, "x", what="gpu")
    with pytest.raises(ValueError, match="learner, publish"):
        run_mode("bf16", [], Path("unused"), "host", stage="rollout")
    result, table = profile_call(lambda: sum(range(1000)), "sum", what="host")
    assert result == 499500 and table.startswith("sum: host")


def test_mode_names_take_per_mode_options():
    """``aligned-w4a16+kvfp8`` is that mode with the FP8 KV cache (bf16 in the same call keeps
    its bf16 cache); unknown bases and options are errors that name the choices."""
    from quarl.bench.train import check_workload, mode_overrides

    assert mode_overrides("aligned-w4a16+kvfp8") == MODES["aligned-w4a16"] + ["--rollout.engine.kv_cache_dtype=fp8"]
    assert mode_overrides("bf16") == MODES["bf16"]
    assert mode_overrides("aligned-w4a16+dense+kvfp8") == MODES["aligned-w4a16"] + [
        "--rollout.engine.dense_weights=on", "--rollout.engine.kv_cache_dtype=fp8"]
    assert mode_overrides("aligned-w8a8-fp8+kvfp8+exact") == MODES["aligned-w8a8-fp8"] + [
        "--rollout.engine.kv_cache_dtype=fp8", "--quant.exact=true"]
    with pytest.raises(ValueError, match="unknown mode option.*kvint4.*\\+kvfp8"):
        mode_overrides("bf16+kvint4")
    with pytest.raises(ValueError, match="unknown mode 'aligned-w3'.*bf16"):
        check_workload("w1", ["bf16", "aligned-w3+kvfp8"])
    assert check_workload("w1-long", ["bf16", "aligned-w8a8-fp8+kvfp8"]).gen == 4096


def test_a_baseline_runs_its_own_quarl_in_a_child_and_its_speedup_is_tabled(tmp_path):
    """``--baseline DIR`` runs each mode under the quarl package in DIR (not the one under
    test, though that one is first in the working directory), records its medians and commit,
    and the table gives new-over-old speedups; a DIR without a package is a clear error."""
    import json
    import os
    import textwrap

    from quarl.bench.common import check_baseline
    from quarl.bench.train import _speedups, run_child, summary_table

    with pytest.raises(ValueError, match="no quarl/ package there.*git archive REV quarl"):
        check_baseline(tmp_path)
    pkg = tmp_path / "base" / "quarl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(textwrap.dedent('''
        import json, os, sys
        args = sys.argv[1:]
        out, mode = args[args.index("--out") + 1], args[args.index("--modes") + 1]
        assert args[:4] == ["bench", "train", "--workload", "w1"] and "--trainer.steps=3" in args
        median = {"step_s": 8.0, "rollout_s": 4.0, "learner_s": 4.0}
        json.dump({"git_commit": os.environ["QUARL_GIT_COMMIT"], "device": "H0", "bf16_tflops_measured": 700.0,
                   "modes": {mode: {"median": median}}}, open(out, "w"))
    '''))
    base = check_baseline(tmp_path / "base")
    got = run_child("w1", "aligned-w4a16", ["--trainer.steps=3"], base, "abc1234", tmp_path)
    assert got == {"median": {"step_s": 8.0, "rollout_s": 4.0, "learner_s": 4.0}, "git_commit": "abc1234",
                   "device": "H0", "bf16_tflops_measured": 700.0}
    with pytest.raises(RuntimeError, match="(?s)failed on mode 'bf16'.*AssertionError"):
        run_child("w1", "bf16", [], base, None, tmp_path)  # (no --trainer.steps: the fake asserts)
    new = {"step_s": 6.4, "rollout_s": 4.0, "learner_s": 2.0}
    result = {"workload": "w1", "device": "cpu", "git_commit": "def5678", "modes": {"aligned-w4a16": {
        "median": new, "baseline": got, "speedup_vs_baseline": _speedups(got["median"], new)}}}
    table = summary_table(result)
    assert "| 1.25x / 1.00x / 2.00x |" in table and "aligned-w4a16 (baseline abc1234) | 8.00 |" in table
    assert os.environ.get("QUARL_GIT_COMMIT") != "abc1234"  # the child's environment only
    json.dumps(result)


def test_a_result_is_saved_with_its_speedups_and_no_temporary_left(tmp_path):
    """``save_result`` (called after every mode) adds step / rollout / learner speedups over
    bf16 and over the baseline, the device and its bf16 rate from the child runs where the
    parent (which leaves the GPUs to them) has none, and replaces the file whole."""
    import json

    from quarl.bench.train import save_result

    out = tmp_path / "r" / "train.json"
    result = {"device": None, "bf16_tflops_measured": None,
              "modes": {"bf16": {"median": {"step_s": 6.0, "rollout_s": 3.0, "learner_s": 3.0}}}}
    save_result(result, out)
    assert result["device"] is None  # (a mode run in this process: the caller measured it)
    result["modes"]["aligned-w4a16"] = {"median": {"step_s": 5.0, "rollout_s": 2.0, "learner_s": 3.0},
                                        "baseline": {"median": {"step_s": 7.5, "rollout_s": 4.0, "learner_s": 3.5}}}
    result["modes"]["aligned-w4a16"] |= {"device": "H0", "bf16_tflops_measured": 700.0}
    save_result(result, out)
    saved = json.loads(out.read_text())
    assert (saved["device"], saved["bf16_tflops_measured"]) == ("H0", 700.0)  # a parent of child runs: theirs
    got = saved["modes"]["aligned-w4a16"]
    assert got["speedup_vs_bf16"] == {"step_s": 1.2, "rollout_s": 1.5, "learner_s": 1.0}
    assert got["speedup_vs_baseline"] == {"step_s": 1.5, "rollout_s": 2.0, "learner_s": 3.5 / 3.0}
    assert [f.name for f in out.parent.iterdir()] == ["train.json"]


def test_a_saved_model_must_have_the_workloads_shape(tmp_path):
    """``--model DIR`` (every mode's process loads the parent's saved random weights through
    it) takes a checkpoint of the workload's shape; anything else is an error naming it."""
    from quarl.bench.train import WORKLOADS, check_model, child_command, save_random_model

    smoke = WORKLOADS["smoke"]
    with pytest.raises(ValueError, match="no config.json there"):
        check_model(tmp_path, smoke)
    tiny = save_random_model("tiny", tmp_path / "tiny")
    with pytest.raises(ValueError, match="matmul parameters, the workload's shape 100m"):
        check_model(tiny, smoke)
    argv, _ = child_command("smoke", "bf16", ["--trainer.steps=2"], tmp_path, "abc", tmp_path / "o.json", None, tiny)
    assert argv[argv.index("--model") + 1] == str(tiny.resolve()) and argv[-1] == "--trainer.steps=2"


def test_every_workload_and_mode_makes_a_valid_run_config(tmp_path):
    """The flags `quarl bench train` hands each mode's run load as a config (later flags win:
    a workload's extras override the common ones)."""
    from quarl.bench.train import MODES, WORKLOADS, mode_overrides, workload_overrides
    from quarl.config import load_run_config

    for name, w in WORKLOADS.items():
        for mode in MODES:
            if mode == "rollout-w4a16" and "--model.lora_rank=64" in w.extra:
                continue  # LoRA runs refuse rollout mode (tests/trainer/test_lora_run.py)
            cfg = load_run_config(None,
                                  workload_overrides(w, None if w.random_base else tmp_path) + mode_overrides(mode))
            assert cfg.rollout.max_new_tokens == w.gen, (name, mode)
    lean = load_run_config(None, workload_overrides(WORKLOADS["full-7b-lean"], tmp_path))
    assert not lean.optim.fp32_master and lean.optim.state_dtype == "bfloat16" and lean.trainer.activation_checkpointing


def test_the_sharded_moe_workload_is_the_lean_full_fine_tune_of_qwen3_30b_a3b():
    """``moe-30b-full-sharded``: the released MoE shape on random weights made in each rank,
    every weight trained (no LoRA), sharded, the lean settings; ``+r3`` turns routing replay
    on for that mode alone; its prompts per GPU split evenly over 3 and 6 GPUs at 4 and 8."""
    from quarl.bench.train import WORKLOADS, mode_overrides, workload_overrides
    from quarl.config import load_run_config

    w = WORKLOADS["moe-30b-full-sharded"]
    assert w.random_base and preset_config(w.shape).num_experts == 128
    flags = workload_overrides(w, None)
    for mode, replay in (("aligned-w4a16+r3", "r3"), ("bf16", "off")):
        cfg = load_run_config(None, flags + mode_overrides(mode))
        assert cfg.model.builtin == "qwen3-30b-a3b" and cfg.model.lora_rank == 0
        assert cfg.trainer.shard_learner and cfg.trainer.activation_checkpointing
        assert not cfg.optim.fp32_master and cfg.optim.state_dtype == "bfloat16"
        assert cfg.rollout.kv_cache_in_update == "release" and cfg.rollout.routing_replay == replay
        assert cfg.rollout.engine.gpu_memory_utilization == 0.6
    assert all(w.prompts * gpus % ranks == 0 for gpus, ranks in ((4, 3), (8, 6), (8, 4)))


def test_a_scaling_run_launches_ranks_and_reports_efficiency(tmp_path):
    """``--gpus``: a count above one runs the mode under torchrun with that many ranks and the
    workload's prompts per GPU (rank 0 writes the result); ``save_result`` gives each count
    its step-time efficiency against one GPU, and the table lists them. Bad counts are
    refused with the fix."""
    import json
    import textwrap

    from quarl.bench.train import run_child, save_result, summary_table
    from quarl.cli.bench_train import parse_gpus

    pkg = tmp_path / "fake" / "quarl"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(textwrap.dedent('''
        import json, os, sys
        args = sys.argv[1:]
        assert os.environ["WORLD_SIZE"] == "2" and args[-1] == "--trainer.prompts_per_step=32"
        if os.environ["RANK"] == "0":
            out, mode = args[args.index("--out") + 1], args[args.index("--modes") + 1]
            json.dump({"modes": {mode: {"median": {"step_s": 8.0}}}}, open(out, "w"))
    '''))
    got = run_child("w1", "bf16", ["--trainer.prompts_per_step=32"], tmp_path / "fake", "abc", tmp_path, gpus=2)
    assert got["median"] == {"step_s": 8.0}
    result = {"workload": "w1", "device": "cpu", "git_commit": "def5678", "modes": {
        "bf16@1gpu": {"median": {"step_s": 7.0}}, "bf16@2gpu": got,
        "aligned-w4a16@1gpu": {"median": {"step_s": 5.0, "rollout_s": 2.0}},
        "aligned-w4a16@2gpu": {"median": {"step_s": 6.25, "rollout_s": 2.5}}}}
    save_result(result, None)
    assert result["modes"]["bf16@2gpu"]["scaling_efficiency"] == 7.0 / 8.0
    assert "rollout_scaling_efficiency" not in result["modes"]["bf16@2gpu"]  # (no rollout times)
    two = result["modes"]["aligned-w4a16@2gpu"]
    assert two["speedup_vs_bf16"] == {"step_s": 8.0 / 6.25}
    # the rollout's own weak-scaling efficiency: the engines run apart, so it shows the step's losses elsewhere
    assert two["rollout_scaling_efficiency"] == 2.0 / 2.5
    assert summary_table(result).endswith("scaling efficiency vs 1 GPU: bf16@2gpu: 88%, aligned-w4a16@2gpu: 80% "
                                          "(rollout 80%)")
    json.dumps(result)
    assert parse_gpus("4,1,2,2", 4) == [1, 2, 4]
    for bad, why in (("1,8", "between 1 and the 4 GPU"), ("0", "between 1"), ("two", "separated by commas")):
        with pytest.raises(ValueError, match=why):
            parse_gpus(bad, 4)


def test_a_benchmark_cut_short_resumes_with_the_runs_it_has(tmp_path, monkeypatch):
    """``--resume``: the runs saved at ``--out`` stay and only the missing ones run; a file
    of another workload, commit or flags is refused with the fix, and --out is required."""
    import json

    import quarl.bench.train as bt

    monkeypatch.setenv("QUARL_GIT_COMMIT", "abc1234")
    monkeypatch.setattr(bt, "save_random_model", lambda shape, out: out)
    ran = []

    def fake_child(workload, mode, extra, root, commit, tmp, profile=None, model=None, stage="learner", gpus=1):
        ran.append(gpus)
        return {"median": {"step_s": 4.0 + gpus}, "git_commit": commit, "device": "H0", "bf16_tflops_measured": 700.0}

    monkeypatch.setattr(bt, "run_child", fake_child)
    out = tmp_path / "scaling.json"
    first = bt.run_benchmark("smoke", ["bf16"], ["--trainer.steps=2"], out, gpus=[1, 2])
    assert ran == [1, 2] and first["extra"] == ["--trainer.steps=2"]
    saved = json.loads(out.read_text())
    del saved["modes"]["bf16@2gpu"]  # as if the call had been cut during the 2-GPU run
    out.write_text(json.dumps(saved))
    ran.clear()
    again = bt.run_benchmark("smoke", ["bf16"], ["--trainer.steps=2"], out, gpus=[1, 2, 4], resume=True)
    assert ran == [2, 4] and sorted(again["modes"]) == ["bf16@1gpu", "bf16@2gpu", "bf16@4gpu"]
    assert json.loads(out.read_text())["modes"]["bf16@4gpu"]["scaling_efficiency"] == 5.0 / 8.0
    with pytest.raises(ValueError, match=r"another benchmark's result \(extra: \['--trainer.steps=2'\] there"):
        bt.run_benchmark("smoke", ["bf16"], ["--trainer.steps=3"], out, gpus=[1], resume=True)
    monkeypatch.setenv("QUARL_GIT_COMMIT", "def5678")
    with pytest.raises(ValueError, match="git_commit: 'abc1234' there, 'def5678' now"):
        bt.run_benchmark("smoke", ["bf16"], ["--trainer.steps=2"], out, gpus=[1], resume=True)
    with pytest.raises(ValueError, match="pass --out"):
        bt.run_benchmark("smoke", ["bf16"], [], None, gpus=[1], resume=True)
    ran.clear()
    fresh = bt.run_benchmark("smoke", ["bf16"], [], tmp_path / "new.json", gpus=[1], resume=True)  # nothing yet
    assert ran == [1] and fresh["device"] == "H0"


def test_the_documented_multi_gpu_commands_run_the_workloads_settings():
    """docs/distributed.md's commands for Qwen3-30B-A3B on several GPUs: each ``quarl bench
    train`` names a workload and modes that exist, and the ``torchrun ... quarl train`` of the
    resume is the sharded workload's aligned-w4a16+r3 run on 4 GPUs (the same run config),
    saving its one step."""
    import shlex

    from quarl.bench.train import WORKLOADS, check_workload, mode_overrides, workload_overrides
    from quarl.config import load_run_config
    from quarl.config.typed import to_dict

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    section = text[text.index("## Qwen3-30B-A3B on several GPUs"):]
    lines = [line.strip() for line in section.splitlines()]
    bench = [shlex.split(line) for line in lines if line.startswith("quarl bench train ")]
    assert len(bench) == 3
    for argv in bench:
        workload, modes = argv[argv.index("--workload") + 1], argv[argv.index("--modes") + 1]
        check_workload(workload, modes.split(","))
    first, resume = [shlex.split(line) for line in lines if line.startswith("torchrun ")]
    assert first[:5] == ["torchrun", "--nproc_per_node=4", "-m", "quarl", "train"]
    w = WORKLOADS["moe-30b-full-sharded"]
    want = workload_overrides(w, None) + mode_overrides("aligned-w4a16+r3") + [
        f"--trainer.prompts_per_step={w.prompts * 4}", "--trainer.steps=1", "--trainer.save_every=1",
        "--trainer.keep_last=1", "--trainer.run_dir=/tmp/moe30b"]
    assert to_dict(load_run_config(None, first[5:])) == to_dict(load_run_config(None, want))
    assert resume[:6] == ["torchrun", "--nproc_per_node=3", "-m", "quarl", "train", "--resume"]
    assert "--trainer.run_dir=/tmp/moe30b" in resume and w.prompts * 4 % 3 == 0
