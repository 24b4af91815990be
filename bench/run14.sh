#!/bin/bash
# Run 14 device calls (persistent SiLU-and-mul + quantizer for many rows; gated GEMM at large M).
#   bash bench/run14.sh tests,silu,gated      bash bench/run14.sh bench,gpu
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARTS=${1:-tests,silu}
TESTS_K="fused_quantizers or gated" TESTS_OUT=tests_silu.txt
if [[ $PARTS == *silu* ]]; then
  timeout ${SILU_TIMEOUT:-200} python3 bench/silu_quant_sweep.py --out $OUT/silu_quant_sweep.json 2>&1 | tee $OUT/silu_quant_sweep.txt | tail -70
fi
if [[ $PARTS == *gated* ]]; then
  timeout ${SWEEP_TIMEOUT:-200} python3 bench/gated_sweep.py --out $OUT/gated_sweep_large.json --ms ${SWEEP_MS:-1024,4096} 2>&1 | tee $OUT/gated_sweep_large.txt | tail -50
fi
source bench/device_parts.sh
if [[ $PARTS == *ab* ]]; then  # lookahead A/B on the 7B rollout (same call)
  timeout ${AB_TIMEOUT:-250} python3 bench/diag_rollout_nolookahead.py --shape qwen2.5-7b --batch 64 --prompt-len 256 --gen-len 1024 \
    --formats bf16,w8a8-fp8 --out $OUT/rollout_nolookahead.json 2>&1 | grep -v '^{' | tail -8
fi
