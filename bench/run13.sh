#!/bin/bash
# Run 13 device calls (gated W8A8 gate/up GEMM with SiLU-and-mul in its epilogue).
#   bash bench/run13.sh tests,sweep,b7      bash bench/run13.sh bench,gpu
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARTS=${1:-tests,sweep}
TESTS_K="gated or w8a8 or fused or act_quant" TESTS_OUT=tests_gated.txt
if [[ $PARTS == *sweep* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/gated_sweep.py --out $OUT/gated_sweep.json ${SWEEP_MS:+--ms $SWEEP_MS} 2>&1 | tee $OUT/gated_sweep.txt | tail -80
fi
source bench/device_parts.sh
