"""``quarl bench rollout``: its options and its summary table (the GPU run itself is tests_gpu's)."""

import argparse

import pytest

from quarl.bench.rollout import summary_table
from quarl.cli import bench_rollout


def _row(fmt: str, dense_bytes: int) -> dict:
    return {"shape": "qwen2.5-7b", "format": fmt, "kv_cache_dtype": "auto", "batch": 256, "generated_tok_per_s": 25123.4,
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
