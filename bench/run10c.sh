#!/bin/bash
# Run 10, third call: after the fp8 accumulator fix. GPU suites, diagnosis, 7B rollout, GEMM bench.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout 270 python3 -m pytest tests_gpu -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu_full.txt | tail -8
timeout 60 python3 bench/diag_w8a8_engine.py 2>&1 | grep -v Warn | tail -8
bash bench/run_rollout_gpu.sh $OUT b7 | tail -6
timeout ${BENCH_TIMEOUT:-200} python3 -m quarl.cli.bench_gemm --reps 15 --models qwen2.5-7b,qwen2.5-1.5b --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
tail -10 $OUT/gemm.txt
