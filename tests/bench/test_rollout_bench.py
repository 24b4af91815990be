"""The rollout benchmark's pure parts: idle time between a decode step's kernels, its summary
table and options, and the comparison against a baseline version in child processes (the GPU
run itself is tests_gpu's)."""

import argparse

import pytest

from quarl.bench.common import idle_gaps
from quarl.bench.rollout import summary_table
from quarl.cli import bench_rollout


def test_idle_gaps_sums_the_holes_and_names_the_kernel_that_waited():
    spans = [("b", 12.0, 20.0), ("a", 0.0, 10.0), ("c", 23.0, 30.0), ("b", 31.5, 40.0),
             ("a", 1000.0, 1010.0)]  # the last one comes after the host's pause between replays
    g = idle_gaps(spans, max_gap_us=100.0)
    assert g["idle_us"] == pytest.approx(2.0 + 3.0 + 1.5)
    assert g["before"] == {"b": (pytest.approx(3.5), 2), "c": (pytest.approx(3.0), 1)}


def test_overlapping_kernels_leave_no_idle_time():
    g = idle_gaps([("a", 0.0, 10.0), ("b", 5.0, 8.0), ("c", 9.0, 12.0), ("d", 12.5, 13.0)])
    assert g["idle_us"] == pytest.approx(0.5) and g["before"] == {"d": (pytest.approx(0.5), 1)}


def test_idle_gaps_bins_hand_computed_stretches():
    """Kernels on two streams, out of order: the idle time is what no kernel covers, binned by
    length (< 5 us, 5-50 us, >= 50 us), the largest gaps named by the kernels either side."""
    from quarl.bench.common import gaps_lines

    ks = [("d", 120.0, 130.0), ("a", 0.0, 10.0), ("b", 12.0, 20.0), ("c2", 15.0, 40.0),  # c2 overlaps b
          ("c", 43.0, 50.0), ("e", 200.0, 201.0)]
    g = idle_gaps(ks, largest=2)
    # gaps: 10->12 (2 us), 40->43 (3 us), 50->120 (70 us), 130->200 (70 us)
    assert g["span_us"] == 201.0 and g["idle_us"] == 145.0
    assert g["bins"] == [[5.0, 2], [0.0, 0], [140.0, 2]]
    assert [x[0] for x in g["largest"]] == [70.0, 70.0] and g["largest"][0][1:] in (["c", "d"], ["d", "e"])
    lines = gaps_lines(g)
    assert "0.1 ms of a 0.2 ms span (72.1%)" in lines[0] and len(lines) == 3
    assert idle_gaps([])["idle_us"] == 0.0


@pytest.mark.parametrize("fmt", ["bf16", "w4a16"])
def test_lora_engine_is_the_one_a_lora_run_builds(fmt):
    """``--lora-rank``: every default target of the engine's model carries an adapter over a
    frozen base in the format, and the engine decodes with it."""
    import torch

    from quarl.bench.rollout import make_engine, random_model
    from quarl.model.config import TransformerConfig
    from quarl.model.lora import DEFAULT_TARGETS
    from quarl.quant import QuantLinear
    from quarl.rollout.config import EngineConfig
    from quarl.rollout.sampling_params import SamplingParams

    cfg = TransformerConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=64)
    model = random_model(cfg, torch.device("cpu"))
    engine = make_engine(model, fmt, EngineConfig(max_num_seqs=2, max_model_len=32), lora_rank=4)
    adapted = [n for n, m in engine.model.named_modules() if getattr(m, "lora", None) is not None]
    assert len(adapted) == len(DEFAULT_TARGETS) * cfg.num_hidden_layers
    bases = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert (len(bases) == len(adapted)) == (fmt != "bf16")
    assert not any(p.requires_grad for n, p in engine.model.named_parameters() if ".lora." not in n)
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=0))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_exact_format_runs_the_engine_in_exact_mode():
    """``w4a16+exact``: the engine of the base format in exact mode (the invariant kernels, no
    fused decode kernels, q/k/v and gate/up fused into one GEMM each), whose log-probs of a
    sequence are the same bits alone and in a batch."""
    import torch

    from quarl.bench.rollout import make_engine, random_model, split_exact
    from quarl.model.config import TransformerConfig
    from quarl.rollout.config import EngineConfig
    from quarl.rollout.sampling_params import SamplingParams

    assert split_exact("w4a16+exact") == ("w4a16", True) and split_exact("bf16") == ("bf16", False)
    cfg = TransformerConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=64)
    model = random_model(cfg, torch.device("cpu")).float()
    engine = make_engine(model, "w4a16+exact", EngineConfig(max_num_seqs=4, max_model_len=32))
    assert engine.runner.exact is not None and not engine.runner.fused
    layer = engine.model.layers[0]  # q/k/v and gate/up as one invariant GEMM each (the same bits per column)
    assert layer.self_attn._fused_qkv.weight.scheme.name == "w4a16" and hasattr(layer.mlp, "_fused_gate_up")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=3)
    alone = engine.generate([[1, 2, 3]], params)[0]
    batch = engine.generate([[1, 2, 3], [7, 8, 9, 10, 11], [4, 5]], params)[0]
    assert batch.token_ids == alone.token_ids
    assert torch.equal(torch.tensor(batch.logprobs), torch.tensor(alone.logprobs))


def test_large_shapes_are_packed_as_they_are_made(monkeypatch):
    """``PACKED_ON_LOAD`` shapes (14B, 32B) in a low-bit format come packed from
    ``random_quantized_model``; in bf16, and other shapes, from ``random_model``."""
    import torch

    from quarl.bench import rollout
    from quarl.model.presets import PRESETS
    from quarl.quant import QuantLinear

    assert {"qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-8b"} <= set(rollout.SHAPES)
    assert rollout.shape_config("qwen2.5-32b", 128).num_hidden_layers == 64
    monkeypatch.setitem(rollout.SHAPES, "tiny", dict(PRESETS["tiny"], eos_token_id=1))
    monkeypatch.setattr(rollout, "PACKED_ON_LOAD", ("tiny",))
    made = []
    real = rollout.random_model
    monkeypatch.setattr(rollout, "random_model", lambda *a, **k: made.append(a) or real(*a, **k))
    packed = rollout.bench_model("tiny", "w4a16", torch.device("cpu"), 64)
    assert not made and sum(isinstance(m, QuantLinear) for m in packed.modules()) == 7 * 2
    plain = rollout.bench_model("tiny", "bf16", torch.device("cpu"), 64)
    assert made and not any(isinstance(m, QuantLinear) for m in plain.modules())


def test_moe_decode_floor_reads_the_experts_a_batch_reaches():
    """An MoE step reads every non-expert weight and, of the experts, the share a batch of B
    tokens picking k of E evenly reaches: 1 - (1 - k/E)^B (moe-tiny: 2 of 8)."""
    import torch

    from quarl.bench.rollout import random_model, step_weight_bytes
    from quarl.model.presets import preset_config

    cfg = preset_config("moe-tiny")
    model = random_model(cfg, torch.device("cpu"))
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." in n)
    rest = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." not in n
               and not (n == "embed_tokens.weight" and model.lm_head is not None))
    assert experts == 2 * 2 * 8 * 3 * 64 * 32  # two sparse layers of 8 experts, bf16
    assert step_weight_bytes(model, 1) == int(rest + experts * 0.25)
    assert step_weight_bytes(model, 4) == int(rest + experts * (1 - 0.75**4))
    assert step_weight_bytes(model, 200) == pytest.approx(rest + experts, rel=1e-6)


def _row(fmt: str, dense_bytes: int) -> dict:
    return {"shape": "qwen2.5-7b", "format": fmt, "kv_cache_dtype": "auto", "batch": 256,
            "generated_tok_per_s": 25123.4,
            "decode_step_ms_mean": 8.853, "decode_step_floor_ms_mean": 5.167, "decode_floor_fraction": 0.58,
            "speedup_vs_bf16": 1.0, "last_step_graph_replay_ms": 9.174, "decode_step_floor_ms_last": 5.892,
            "decode_tiling": [128, 4, 8, "triton"], "dense_weight_bytes": dense_bytes}


def test_the_table_names_the_dense_copies_a_weight_only_engine_kept():
    result = {"device": "NVIDIA H200", "ceilings": {"bandwidth": 4.0e12, "bf16_flops": 7.7e14},
              "rows": [_row("bf16", 0), _row("w4a16", 13_060_000_000), {"shape": "qwen2.5-7b", "format": "w4a16",
                                                                       "error": "CUDA out of memory"}]}
    lines = summary_table(result).splitlines()
    assert lines[0] == "NVIDIA H200  bw 4.00 TB/s  bf16 770 TFLOP/s"
    assert "dense" not in lines[2] and lines[2].split()[:5] == ["qwen2.5-7b", "bf16", "auto", "256", "25123"]
    assert lines[3].endswith("dense copies 13.1 GB")
    assert "ERROR CUDA out of memory" in lines[4]


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_dense_weights_is_an_engine_setting_of_the_run(value):
    p = argparse.ArgumentParser()
    bench_rollout._add_args(p)
    assert p.parse_args(["--dense-weights", value]).dense_weights == value
    assert p.parse_args([]).dense_weights == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--dense-weights", "maybe"])


def test_a_baseline_child_runs_the_settings_of_the_parent():
    """The command each version runs for one row parses back, through the CLI's own parser, to
    the settings of the run that compares them."""
    from pathlib import Path

    from quarl.bench.rollout import child_argv

    argv = child_argv("qwen2.5-7b", 384, 128, 256, "w4a16", "fp8", 8,
                      {"dependent_launches": False, "dense_weights": "off"}, Path("/tmp/x.json"))
    assert argv[1:5] == ["-m", "quarl", "bench", "rollout"]
    p = argparse.ArgumentParser()
    bench_rollout._add_args(p)
    a = p.parse_args(argv[5:])
    assert (a.shape, a.batch, a.prompt_len, a.gen_len, a.formats, a.kv_cache_dtype, a.lora_rank) == \
        ("qwen2.5-7b", [384], 128, 256, "w4a16", "fp8", 8)
    assert (a.dependent_launches, a.dense_weights, a.out, a.baseline, a.hf_gen_len) == \
        ("off", "off", "/tmp/x.json", None, 0)
    d = p.parse_args(child_argv("qwen2.5-1.5b", 64, 16, 32, "bf16", "auto", 0, None, Path("/tmp/y.json"))[5:])
    assert (d.dependent_launches, d.dense_weights) == ("on", "auto")


def _timed_row(fmt: str, tok_s: float, step_ms: float) -> dict:
    return {**_row(fmt, 0), "generated_tok_per_s": tok_s, "decode_step_ms_median": step_ms}


def test_each_row_runs_under_this_code_then_the_baselines(tmp_path, monkeypatch):
    """With a baseline every row runs twice in child processes, this version's first: the row
    keeps the baseline's and the speedups over it (tok/s, and the median decode step as old
    time over new, by hand below), a failing child leaves an error row naming it, and the table
    prints one comparison line per compared row."""
    import json

    import torch

    from quarl.bench import rollout
    from quarl.bench.common import package_root
    from quarl.bench.timing import Ceilings

    base = tmp_path / "base"
    (base / "quarl").mkdir(parents=True)
    (base / "quarl" / "__init__.py").write_text("")
    monkeypatch.setattr(rollout, "measure_ceilings", lambda device: Ceilings(4.0e12, 7.7e14, 1.4e15))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    calls = []
    times = {(True, "bf16"): (25000.0, 11.5), (False, "bf16"): (24800.0, 11.6),
             (True, "w4a16"): (23500.0, 12.35), (False, "w4a16"): (23000.0, 12.68)}

    def fake_child(root, commit, tmp, shape, batch, prompt_len, gen_len, fmt, kv, lora_rank, engine_kw):
        ours = root == package_root()
        calls.append(("new" if ours else "base", fmt, kv, commit))
        assert (shape, batch, prompt_len, gen_len, lora_rank, engine_kw) == ("qwen2.5-7b", 384, 128, 256, 0,
                                                                              {"dense_weights": "off"})
        if fmt == "nvfp4" and not ours:
            raise RuntimeError(f"the run of quarl in {root} failed on nvfp4 kv=auto (exit 2): unknown format")
        return {**_timed_row(fmt, *times.get((ours, fmt), (20000.0, 14.0))), "git_commit": commit, "batch": batch}

    out = tmp_path / "r.json"
    result = rollout.run_benchmark("qwen2.5-7b", 384, 128, 256, ["bf16", "w4a16", "nvfp4"], out=str(out),
                                   engine_kw={"dense_weights": "off"}, baseline=base, baseline_commit="0d3a7d8",
                                   child=fake_child)
    assert [c[:2] for c in calls] == [("new", "bf16"), ("base", "bf16"), ("new", "w4a16"), ("base", "w4a16"),
                                      ("new", "nvfp4"), ("base", "nvfp4")]
    assert {c[3] for c in calls if c[0] == "base"} == {"0d3a7d8"}
    bf16, w4, bad = result["rows"]
    assert w4["speedup_vs_baseline"] == pytest.approx(23500.0 / 23000.0)
    assert w4["decode_step_vs_baseline"] == pytest.approx(12.68 / 12.35)
    assert w4["baseline"]["git_commit"] == "0d3a7d8" and w4["speedup_vs_bf16"] == pytest.approx(23500.0 / 25000.0)
    assert bf16["speedup_vs_baseline"] == pytest.approx(25000.0 / 24800.0)
    assert "error" in bad and "unknown format" in bad["error"] and str(base) in bad["error"]
    assert json.loads(out.read_text())["rows"][1]["baseline"]["generated_tok_per_s"] == 23000.0
    lines = [x for x in summary_table(result).splitlines() if "against the baseline" in x]
    assert len(lines) == 2
    assert lines[1] == ("w4a16 kv=auto against the baseline (0d3a7d8): 23000 -> 23500 tok/s (1.022x), "
                        "median decode step 12.680 -> 12.350 ms (1.027x)")
    with pytest.raises(ValueError, match="no quarl/ package there"):
        rollout.run_benchmark("qwen2.5-7b", 8, 8, 8, ["bf16"], baseline=tmp_path / "none", child=fake_child)


def test_several_batch_sizes_run_in_one_call_each_against_its_own_bf16_row(tmp_path, monkeypatch):
    """``--batch 64,256``: every format at each batch size, in that order; each row's
    ``speedup_vs_bf16`` against the bf16 row of its own batch (by hand below); an engine that
    fails leaves an error row that names its batch; a bad list is a clear parse error."""
    import torch

    from quarl.bench import rollout
    from quarl.bench.timing import Ceilings

    monkeypatch.setattr(rollout, "measure_ceilings", lambda device: Ceilings(4.0e12, 7.7e14, 1.4e15))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    tok = {(64, "bf16"): 1000.0, (64, "w4a16"): 2500.0, (256, "bf16"): 3000.0, (256, "w4a16"): 4500.0}
    ran = []

    def fake_engine(shape, fmt, batch, prompt_len, gen_len, ceil, device, engine_kw=None, lora_rank=0):
        ran.append((batch, fmt))
        if (batch, fmt) == (256, "w8a8-fp8"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {**_timed_row(fmt, tok.get((batch, fmt), 2000.0), 10.0), "batch": batch}

    monkeypatch.setattr(rollout, "run_engine", fake_engine)
    result = rollout.run_benchmark("qwen3-30b-a3b", [64, 256], 256, 1024, ["bf16", "w4a16", "w8a8-fp8"],
                                   out=str(tmp_path / "r.json"))
    assert ran == [(64, "bf16"), (64, "w4a16"), (64, "w8a8-fp8"), (256, "bf16"), (256, "w4a16"), (256, "w8a8-fp8")]
    rows = {(r["batch"], r["format"]): r for r in result["rows"]}
    assert rows[64, "w4a16"]["speedup_vs_bf16"] == pytest.approx(2.5)
    assert rows[64, "w8a8-fp8"]["speedup_vs_bf16"] == pytest.approx(2.0)
    assert rows[256, "w4a16"]["speedup_vs_bf16"] == pytest.approx(1.5)
    assert rows[256, "bf16"]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert "out of memory" in rows[256, "w8a8-fp8"]["error"]
    p = argparse.ArgumentParser()
    bench_rollout._add_args(p)
    assert p.parse_args(["--batch", "64,256"]).batch == [64, 256] and p.parse_args([]).batch == [256]
    for bad in ("64,x", "0", ","):
        with pytest.raises(SystemExit):
            p.parse_args(["--batch", bad])


def test_a_child_that_fails_is_an_error_naming_the_run_and_its_last_lines(tmp_path):
    """A real child process: on a machine without a GPU the child's own check stops it, and
    the parent's error names the version's directory, the row and the child's message."""
    import shutil
    from pathlib import Path

    from quarl.bench.rollout import run_child

    base = tmp_path / "base"
    shutil.copytree(Path(__file__).resolve().parents[2] / "quarl", base / "quarl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.raises(RuntimeError) as e:
        run_child(base, "abc1234", tmp_path, "qwen2.5-1.5b", 8, 8, 8, "w4a16", "auto")
    msg = str(e.value)
    assert f"the run of quarl in {base} failed on mode 'w4a16 kv=auto' (exit 2)" in msg
    assert "needs a CUDA GPU" in msg


def test_baseline_settings_that_cannot_run_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no quarl/ package there"):
        bench_rollout.main(["--baseline", str(tmp_path)])
    with pytest.raises(ValueError, match="--baseline and --profile-kernels do not combine"):
        bench_rollout.main(["--baseline", str(tmp_path), "--profile-kernels"])
