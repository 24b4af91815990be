#!/bin/bash
# Run 11 device calls (block-tiled CUDA w4 kernel for 16 < M <= 64).
#   bash bench/run11.sh tile,sweep      bash bench/run11.sh bench,b7,gpu
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PARTS=${1:-tile,sweep}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
if [[ $PARTS == *tile* ]]; then
  timeout 200 python3 -m pytest tests_gpu/quant/test_fast_paths.py -q -x -p no:cacheprovider -k "tile" > $OUT/tests_tile.txt 2>&1
  tail -30 $OUT/tests_tile.txt
fi
if [[ $PARTS == *sweep* ]]; then
  QUARL_W4_TILE_MAX_M=0 timeout ${SWEEP_TIMEOUT:-400} python3 bench/w4_tile_sweep.py --budget ${SWEEP_BUDGET:-330} --out $OUT/w4_tile_sweep.json 2>&1 | tee $OUT/w4_tile_sweep.txt | tail -50
fi
source bench/device_parts.sh
