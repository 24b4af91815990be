"""Kernels only a GPU runs, compiled for sm_90 without one (tests/quant/sm90_compile.py): the
interpreter the other CPU tests use runs code that Triton's compiler may refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_the_engines_newer_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-m", "tests.quant.sm90_compile"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    sizes = json.loads(run.stdout)
    assert len(sizes) == 9 and all(n > 1000 for n in sizes.values()), sizes
    # the q / k norms add code (they are compiled in, not dropped)
    assert sizes["rope_store fp8=False qk_norm=True"] > sizes["rope_store fp8=False qk_norm=False"]
