#!/bin/bash
# Device-call parts shared by the run scripts (sourced; OUT and PARTS set by the caller):
# bench (quarl bench gemm, 7B), b7 (7B rollout bench), gpu (the whole GPU suite).
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
