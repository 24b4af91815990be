#!/bin/bash
# One device call: GPU tests, tile sweep, full benchmark. Results under $OUT.
# Usage (on the GPU machine, repo root): QUARL_GIT_COMMIT=<sha> bash bench/gpu_run.sh [sweep_budget_s]
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout ${TEST_TIMEOUT:-120} python3 -m pytest tests_gpu/quant -q --maxfail=4 -p no:cacheprovider 2>&1 | tail -12 | tee $OUT/tests_gpu.txt
if [ "${SWEEP:-1}" = 1 ]; then
  timeout $(( ${1:-180} + 40 )) python3 bench/gemm_sweep.py --out $OUT/sweep.json --budget ${1:-180} > $OUT/sweep.txt 2>&1
  grep -v "^ \|Error\|WRONG" $OUT/sweep.txt | tail -40
fi
timeout ${BENCH_TIMEOUT:-230} python3 -m quarl.cli.bench_gemm --reps 15 --models ${MODELS:-qwen2.5-7b,qwen2.5-1.5b} --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
tail -40 $OUT/gemm.txt
