#!/bin/bash
# One device call: GPU tests, tile sweep, full benchmark. Results under $OUT.
# Usage (on the GPU machine, repo root): QUARL_GIT_COMMIT=<sha> bash bench/gpu_run.sh [sweep_budget_s]
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout 150 python3 -m pytest tests_gpu/quant -q --maxfail=8 -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/tests_gpu.txt
if [ "${SWEEP:-1}" = 1 ]; then
  timeout 170 python3 bench/gemm_sweep.py --out $OUT/sweep.json --budget ${1:-150} > $OUT/sweep.txt 2>&1; tail -5 $OUT/sweep.txt
fi
timeout ${BENCH_TIMEOUT:-230} python3 -m quarl.cli.bench_gemm --reps 15 --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
tail -60 $OUT/gemm.txt
