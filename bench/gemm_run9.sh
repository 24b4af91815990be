#!/bin/bash
# Run 9 device call: the GPU suites (quant with the CUDA fragment kernel, rollout), then the
# full GEMM bench (every format, 7B and 1.5B shapes). The frag sweep itself:
#   PYTHONPATH=. python3 bench/gemm_sweep.py --kinds w4 --budget 150 --out $OUT/sweep.json
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests_gpu -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
tail -4 $OUT/tests_gpu_full.txt | tee $OUT/tests_gpu.txt
timeout ${BENCH_TIMEOUT:-300} python3 -m quarl.cli.bench_gemm --reps 15 --models ${MODELS:-qwen2.5-7b,qwen2.5-1.5b} --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
grep "qwen2.5-7b" $OUT/gemm.txt | grep "M=1 \|M=16 \|M=64 " | cut -c1-150; tail -5 $OUT/gemm.txt
