#!/bin/bash
# Run 16 on the device (H100): wgmma w4 kernel correctness + sweep at M = 32 / 64 with ncu stall
# reasons, the GPU quant suite, `quarl bench gemm`, and the 7B rollout benchmark at B = 64.
#   QUARL_GIT_COMMIT=<sha> bash bench/run16.sh $OUT [wgmma,sweep,ncu,quant,gemm] [label]
set -u
OUT=$1
PARTS=${2:-wgmma,sweep,ncu}
LABEL=${3:-a}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [[ $PARTS == *wgmma* ]]; then
  timeout 240 python3 -m pytest tests_gpu/quant/test_fast_paths.py -q -x -k "wgmma" 2>&1 | tail -4
fi
if [[ $PARTS == *sweep* ]]; then
  WGMMA_CANDIDATES=${WGMMA_CANDIDATES:-"1,4;2,4;2,6"} BPS=${BPS:-1,2} timeout 240 python3 bench/w4_wgmma_sweep.py \
    --out $OUT/w4_wgmma_sweep_${LABEL}.json --ms ${MS:-64,32} --budget 200 --skip-check 2>&1 | tail -30
fi
if [[ $PARTS == *ncu* ]]; then
  timeout 200 /usr/local/cuda/bin/ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active \
    -k regex:w4a16_wgmma python3 bench/w4_wgmma_ncu.py 37888,3584 "${NCU_SPEC:-64:2,4,1}" > $OUT/w4_wgmma_ncu_${LABEL}.txt 2>&1
  grep -E "stalled.*ratio|Duration|Issued Warp|Registers Per|Warp Cycles Per Issued" $OUT/w4_wgmma_ncu_${LABEL}.txt | sort -k3 -g | tail -20
fi
if [[ $PARTS == *quant* ]]; then
  timeout 300 python3 -m pytest tests_gpu/quant -q -x > $OUT/tests_gpu_quant_h100_run16.txt 2>&1
  tail -3 $OUT/tests_gpu_quant_h100_run16.txt
fi
if [[ $PARTS == *gemm* ]]; then
  timeout 200 python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine --out $OUT/gemm_h100.json 2>&1 | tail -12
fi
