#!/bin/bash
# One device call (the GPU machine; repo root): the parts named in PARTS, each writing under OUT.
#   QUARL_GIT_COMMIT=<sha> bash bench/device.sh $OUT tests,gemm,rollout,train [label]
# Parts: tests (the whole GPU suite), quant / rtest (its quant or rollout half), gemm (quarl bench
# gemm, 7B shapes), rollout (7B, B = 64, bf16 / w4a16 / fp8), train (quarl bench train, TRAIN_WORKLOAD,
# default w1, TRAIN_MODES). Each part has a time limit (env *_S) so one slow part cannot eat the call.
set -u
# git inside the device's copy of the checkout reports the session's first commit, not this one
: "${QUARL_GIT_COMMIT:?set QUARL_GIT_COMMIT=<sha of the code sent> (git on the device copy is stale)}"
OUT=$1
PARTS=${2:-tests}
LABEL=${3:-a}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu_${LABEL}.txt 2>&1
head -2 $OUT/gpu_${LABEL}.txt
suite() {  # suite NAME PATHS...: pytest under a limit, summary lines to stdout
  local name=$1; shift
  timeout ${TESTS_S:-420} python3 -m pytest "$@" -q -p no:cacheprovider > $OUT/tests_gpu_${name}_${LABEL}.txt 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/tests_gpu_${name}_${LABEL}.txt | tail -8
}
[[ $PARTS == *tests* ]] && suite all tests_gpu
[[ $PARTS == *quant* ]] && suite quant tests_gpu/quant
[[ $PARTS == *rtest* ]] && suite rollout tests_gpu/rollout
if [[ $PARTS == *gemm* ]]; then
  timeout ${GEMM_S:-300} python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine \
    --out $OUT/gemm_${LABEL}.json 2>&1 | tail -14
fi
if [[ $PARTS == *rollout* ]]; then
  timeout ${ROLLOUT_S:-240} python3 -m quarl bench rollout --shape qwen2.5-7b --batch 64 --prompt-len 256 \
    --gen-len ${GEN_LEN:-1024} --formats ${FORMATS:-bf16,w4a16,w8a8-fp8} --out $OUT/rollout_7b_b64_${LABEL}.json 2>&1 | tail -8
fi
if [[ $PARTS == *train* ]]; then
  timeout ${TRAIN_S:-500} python3 -m quarl bench train --workload ${TRAIN_WORKLOAD:-w1} \
    ${TRAIN_MODES:+--modes $TRAIN_MODES} --out $OUT/train_${TRAIN_WORKLOAD:-w1}_${LABEL}.json 2>&1 | tail -12
fi
