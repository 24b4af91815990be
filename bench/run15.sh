#!/bin/bash
# Run 15 on the device: GPU quant suite, wgmma sweep at small M with the new dispatch, gemm bench.
#   QUARL_GIT_COMMIT=<sha> bash bench/run15.sh $OUT [tests,sweep,gemm]
set -u
OUT=$1
PARTS=${2:-tests,sweep,gemm}
export PYTHONPATH=.
if [[ $PARTS == *tests* ]]; then
  timeout 300 python3 -m pytest tests_gpu/quant -q -x 2>&1 | tail -15 | tee $OUT/tests_gpu_quant_h200_run15.txt
fi
if [[ $PARTS == *sweep* ]]; then
  WGMMA_CANDIDATES="1,4;2,4" BPS=1,2,4 timeout 240 python3 bench/w4_wgmma_sweep.py --out $OUT/w4_wgmma_sweep_h200_small_m.json --ms 1,4,8,16 --budget 200 --skip-check 2>&1 | tail -30
fi
if [[ $PARTS == *gemm* ]]; then
  timeout 200 python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine --out $OUT/gemm_h200.json 2>&1 | tail -12
fi
