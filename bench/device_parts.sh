#!/bin/bash
# Device-call parts shared by the run scripts (sourced; OUT and PARTS set by the caller):
# tests (GPU tests matching $TESTS_K, output $OUT/$TESTS_OUT), bench (quarl bench gemm, 7B),
# b7 (7B rollout bench), gpu (the whole GPU suite).
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
if [[ $PARTS == *tests* ]]; then
  timeout 240 python3 -m pytest tests_gpu/quant/test_fast_paths.py tests_gpu/rollout/test_gpu_rollout.py -q -p no:cacheprovider \
    -k "$TESTS_K" > $OUT/$TESTS_OUT 2>&1
  grep -E "FAILED|Error|passed|failed" $OUT/$TESTS_OUT | tail -15
fi
if [[ $PARTS == *bench* ]]; then
  timeout ${BENCH_TIMEOUT:-400} python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine --out $OUT/gemm_h200.json > $OUT/gemm.txt 2>&1
  tail -14 $OUT/gemm.txt
fi
if [[ $PARTS == *b7* ]]; then
  bash bench/run_rollout_gpu.sh $OUT b7
fi
if [[ $PARTS == *gpu* ]]; then
  timeout ${TEST_TIMEOUT:-270} python3 -m pytest tests_gpu -q -p no:cacheprovider > $OUT/tests_gpu_full.txt 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu_full.txt | tail -15
fi
