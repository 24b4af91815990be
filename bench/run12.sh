#!/bin/bash
# Run 12 device calls (W8A8: hardware e4m3 quantizer, TMA GEMM for large M).
#   bash bench/run12.sh tests,sweep      bash bench/run12.sh bench,b7,gpu
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARTS=${1:-tests,sweep}
TESTS_K="e4m3 or act_quant or w8a8 or fused_quantizers or (fast_path and (int8 or fp8)) or qat_forward or dispatch" TESTS_OUT=tests_w8a8.txt
if [[ $PARTS == *sweep* ]]; then
  timeout ${SWEEP_TIMEOUT:-420} python3 bench/w8a8_sweep.py --budget ${SWEEP_BUDGET:-300} --parts ${SWEEP_PARTS:-act,fp8,int8} --out $OUT/w8a8_sweep.json 2>&1 | tee $OUT/w8a8_sweep.txt | grep -v "^ " | tail -60
fi
source bench/device_parts.sh
