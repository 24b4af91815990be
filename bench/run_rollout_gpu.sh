#!/usr/bin/env bash
# One device call: GPU tests of the rollout engine, then the rollout benchmarks.
# Usage (repo root, GPU machine): bash bench/run_rollout_gpu.sh [OUT_DIR] [parts]
# parts: comma list of tests,b15,b7 (default all). Set QUARL_GIT_COMMIT=<sha> where the copy has no .git.
set -u
OUT=${1:-${OUT:-/tmp/rollout_out}}
PARTS=${2:-tests,b15,b7}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [[ $PARTS == *tests* ]]; then
  timeout 180 python3 -m pytest tests_gpu/rollout -q -x -p no:cacheprovider 2>&1 | tee "$OUT/rollout_gpu_tests.log" | tail -25
fi
if [[ $PARTS == *b15* ]]; then
  timeout 200 python3 -m quarl.cli.bench_rollout --shape qwen2.5-1.5b --batch 256 --prompt-len 256 --gen-len 1024 \
    --formats bf16 --hf-gen-len 128 --out "$OUT/rollout_qwen2.5-1.5b.json" 2>&1 | tee "$OUT/rollout_b15.log" | grep -v '^{' | tail -20
fi
if [[ $PARTS == *b7* ]]; then
  timeout 300 python3 -m quarl.cli.bench_rollout --shape qwen2.5-7b --batch 64 --prompt-len 256 --gen-len 1024 \
    --formats bf16,w4a16,w8a8-fp8,w8a8-int8 --out "$OUT/rollout_qwen2.5-7b.json" 2>&1 | tee "$OUT/rollout_b7.log" | grep -v '^{' | tail -20
fi
