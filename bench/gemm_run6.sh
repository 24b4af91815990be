#!/bin/bash
# Run 6 device call: fp8 diagnosis, GPU tests (while the w4 candidates compile), w4 sweep.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
timeout 60 python3 bench/gemm_fp8_diag.py $OUT/fp8_diag.json > $OUT/fp8_diag.txt 2>&1
timeout ${WARM_TIMEOUT:-150} python3 bench/gemm_sweep.py --kinds w4 --warm-procs 12 --warm-only --out $OUT/warm.json > $OUT/warm.txt 2>&1 &
WARM=$!
timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests_gpu/quant -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
tail -15 $OUT/tests_gpu_full.txt > $OUT/tests_gpu.txt
wait $WARM
timeout $(( ${SWEEP_BUDGET:-150} + 60 )) python3 bench/gemm_sweep.py --kinds w4 --budget ${SWEEP_BUDGET:-150} --out $OUT/sweep.json > $OUT/sweep.txt 2>&1
cat $OUT/fp8_diag.txt | cut -c1-600; cat $OUT/tests_gpu.txt; cat $OUT/warm.txt | tail -3; grep -v "^ \|Error\|WRONG" $OUT/sweep.txt | tail -40
