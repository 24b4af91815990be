#!/bin/bash
# Run 10, second call: GPU suites, engine-vs-learner diagnosis, 7B rollout bench, GEMM bench.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout 200 python3 -m pytest tests_gpu/rollout tests_gpu/quant -q -x -p no:cacheprovider -k "fused or fp8 or int8 or graph or load" > $OUT/tests_gpu_part.txt 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu_part.txt | tail -8
timeout 60 python3 bench/diag_w8a8_engine.py 2>&1 | grep -v Warn | tail -8
bash bench/run_rollout_gpu.sh $OUT b7 | tail -6
timeout ${BENCH_TIMEOUT:-250} python3 -m quarl.cli.bench_gemm --reps 15 --models qwen2.5-7b --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
tail -12 $OUT/gemm.txt
