#!/bin/bash
# Run 10 device calls (quantized q/k/v and gate/up fused in the engine).
#   part A: bash bench/run10.sh tests,b7     part B: bash bench/run10.sh sweep
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARTS=${1:-tests,b7}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
if [[ $PARTS == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-270} python3 -m pytest tests_gpu -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu_full.txt | tail -15
fi
if [[ $PARTS == *b7* ]]; then
  bash bench/run_rollout_gpu.sh $OUT b7
fi
if [[ $PARTS == *sweep* ]]; then
  timeout ${SWEEP_TIMEOUT:-540} python3 bench/gemm_sweep.py --kinds fp8,int8,w4 --warm-procs 14 --budget ${SWEEP_BUDGET:-330} --out $OUT/sweep.json > $OUT/sweep.txt 2>&1
  grep -v "^ \|Error\|WRONG" $OUT/sweep.txt | tail -60
fi
