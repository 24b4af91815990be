#!/bin/bash
# Run 18 on the device: the wgmma w4 kernel's single-tile variant (more blocks per SM instead
# of double-buffered folds) at M = 32 / 64: GPU tests, then the sweep on the 7B shapes.
#   QUARL_GIT_COMMIT=<sha> bash bench/run18.sh $OUT [wgmma,sweep,quant,gemm,b7] [label]
set -u
OUT=$1
PARTS=${2:-wgmma,sweep}
LABEL=${3:-a}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [[ $PARTS == *wgmma* ]]; then
  timeout 300 python3 -m pytest tests_gpu/quant/test_fast_paths.py -q -x -k "wgmma or tile or frag" 2>&1 | tail -4
fi
if [[ $PARTS == *sweep* ]]; then
  WGMMA_CANDIDATES=${WGMMA_CANDIDATES:-"1,4;2,6;4,4,1,1;4,3,1,1;3,4,1,1;2,4,1,2;1,3,1,4"} BPS=${BPS:-1,2,4} \
    timeout ${SWEEP_S:-300} python3 bench/w4_wgmma_sweep.py \
    --out $OUT/w4_wgmma_sweep_${LABEL}.json --ms ${MS:-64,32} --budget ${BUDGET:-260} --skip-check 2>&1 | tail -30
fi
if [[ $PARTS == *quant* ]]; then
  timeout 300 python3 -m pytest tests_gpu/quant -q -x > $OUT/tests_gpu_quant_${LABEL}.txt 2>&1
  tail -3 $OUT/tests_gpu_quant_${LABEL}.txt
fi
if [[ $PARTS == *gemm* ]]; then
  timeout 200 python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine --out $OUT/gemm_h100.json 2>&1 | tail -12
fi
if [[ $PARTS == *b7* ]]; then
  timeout 200 python3 -m quarl.cli.bench_rollout --shape qwen2.5-7b --batch 64 --prompt-len 256 --gen-len 1024 \
    --formats bf16,w4a16,w8a8-fp8 --out $OUT/rollout_7b_b64_${LABEL}.json 2>&1 | tail -8
fi
if [[ $PARTS == *ncu* ]]; then  # NCU_SHAPE=n,k NCU_SPEC="64:1,4,1;64:4,4,1,1,1"
  timeout 240 /usr/local/cuda/bin/ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active,smsp__cycles_active.avg,sm__cycles_elapsed.max,smsp__inst_executed.sum \
    -k regex:w4a16_wgmma python3 bench/w4_wgmma_ncu.py ${NCU_SHAPE:-3584,3584} "${NCU_SPEC:-64:1,4,1}" > $OUT/w4_wgmma_ncu_${LABEL}.txt 2>&1
  grep -E "w4a16_wgmma|Duration|Grid Size|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Executed Ipc A|inst_executed.sum|cycles_active.avg" $OUT/w4_wgmma_ncu_${LABEL}.txt | head -80
fi
if [[ $PARTS == *silu* ]]; then
  timeout 120 python3 -m pytest tests_gpu/quant/test_fast_paths.py -q -x -k "e4m3" 2>&1 | tail -2
  timeout 200 python3 bench/silu_quant_extra.py --ms ${SILU_MS:-256,1024,4096} --out $OUT/silu_quant_extra_${LABEL}.json
fi
if [[ $PARTS == *trace* ]]; then  # timing-probe build of the wgmma kernel, K sweep
  timeout ${TRACE_S:-400} python3 bench/w4_trace.py --out $OUT/w4_trace_${LABEL}.json --ms ${MS:-1,16,64} 2>&1 | tail -40
fi
if [[ $PARTS == *rtest* ]]; then
  timeout 240 python3 -m pytest tests_gpu/rollout -q > $OUT/rollout_gpu_tests_${LABEL}.txt 2>&1
  grep -E "FAILED|Error|passed|failed" $OUT/rollout_gpu_tests_${LABEL}.txt | tail -8
fi
