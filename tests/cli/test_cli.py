"""The real CLI, run as a subprocess."""

from __future__ import annotations

import subprocess
import sys


def _quarl(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "quarl", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_help_lists_commands():
    out = _quarl("--help").stdout
    assert "generate" in out


def test_generate_builtin_and_checkpoint(hf_checkpoint):
    r = _quarl("generate", "--prompt", "12+7=", "--max-new-tokens", "5", "--greedy", "--show-logprobs")
    assert "[5 tokens" in r.stdout and "logprobs:" in r.stdout
    _, path, _ = hf_checkpoint
    r = _quarl("generate", "--model", str(path), "--prompt", "ab", "--max-new-tokens", "3", check=False)
    # tiny HF checkpoints have vocab 96 < the built-in tokenizer's 128: a clear error, exit code 2
    assert r.returncode == 2 and "--tokenizer" in r.stderr


def test_generate_missing_model_dir(tmp_path):
    r = _quarl("generate", "--model", str(tmp_path / "nope"), "--prompt", "x", check=False)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_bench_commands_need_a_gpu():
    for suite in ("gemm", "rollout"):
        r = _quarl("bench", suite, "--help")
        assert "--out" in r.stdout
        r = _quarl("bench", suite, check=False)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
