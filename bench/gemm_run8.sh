#!/bin/bash
# Run 8 device call: GPU tests (while the w4 candidates compile), w4 WORDS / no-pipeline sweep,
# then the full GEMM bench with the sweep's best single w4 config (if it beats the default by > 2%).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout 150 python3 bench/gemm_sweep.py --kinds w4 --warm-procs 12 --warm-only --out $OUT/warm.json > $OUT/warm.txt 2>&1 &
WARM=$!
timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests_gpu/quant -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
tail -15 $OUT/tests_gpu_full.txt > $OUT/tests_gpu.txt
wait $WARM
timeout $(( ${SWEEP_BUDGET:-80} + 60 )) python3 bench/gemm_sweep.py --kinds w4 --budget ${SWEEP_BUDGET:-80} --out $OUT/sweep.json > $OUT/sweep.txt 2>&1
python3 bench/gemm_pick_w4.py $OUT/sweep.json > $OUT/pick.sh 2> $OUT/pick.txt
. $OUT/pick.sh
timeout ${BENCH_TIMEOUT:-240} python3 -m quarl.cli.bench_gemm --reps 15 --models ${MODELS:-qwen2.5-7b,qwen2.5-1.5b} --out $OUT/gemm.json > $OUT/gemm.txt 2>&1
cat $OUT/tests_gpu.txt; tail -2 $OUT/warm.txt; grep -v "^ \|Error\|WRONG" $OUT/sweep.txt | tail -20; cat $OUT/pick.sh $OUT/pick.txt; grep "qwen2.5-7b" $OUT/gemm.txt | grep -v "M=256\|M=1024\|M=4096" | cut -c1-120; tail -5 $OUT/gemm.txt
