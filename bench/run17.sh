#!/bin/bash
# Run 17 on the device: the W8A8 TMA kernel's tail split and warp-specialized loop at M >= 256
# (GPU tests of the W8A8 configs, then bench/w8a8_sweep.py on the 7B engine shapes).
#   QUARL_GIT_COMMIT=<sha> bash bench/run17.sh $OUT [tests,sweep,quant,gemm,b7] [label]
set -u
OUT=$1
PARTS=${2:-tests,sweep}
LABEL=${3:-a}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [[ $PARTS == *tests* ]]; then
  timeout 200 python3 -m pytest tests_gpu/quant/test_fast_paths.py -q -x -k "w8a8 or int8 or fp8" 2>&1 | tail -4
  timeout 200 python3 -m pytest tests_gpu/rollout -q > $OUT/rollout_gpu_tests_${LABEL}.txt 2>&1
  grep -E "FAILED|Error|passed|failed" $OUT/rollout_gpu_tests_${LABEL}.txt | tail -12
fi
if [[ $PARTS == *ab* ]]; then  # old checkout in .carry/old (carry it), interleaved with this one
  for lbl in old new old new; do
    if [[ $lbl == old ]]; then P=.carry/old; else P=.; fi
    PYTHONPATH=$P timeout 150 python3 bench/ab_w8a8.py --label $lbl --ms ${AB_MS:-256,1024,4096} --out $OUT/ab_${LABEL}.jsonl > /dev/null 2>&1 || echo "ab $lbl failed"
  done
  python3 - $OUT/ab_${LABEL}.jsonl <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
g = collections.defaultdict(list)
for r in rows:
    g[(r["M"], r["layer"], r["format"], r["label"])].append(r["us"])
for (m, layer, fmt, lbl) in sorted(k for k in g if k[3] == "new"):
    old, new = g[(m, layer, fmt, "old")], g[(m, layer, fmt, "new")]
    print(f"{fmt:10} M={m:<5} {layer:22} old {' '.join(f'{x:7.1f}' for x in old)}  new {' '.join(f'{x:7.1f}' for x in new)} us")
PY
fi
if [[ $PARTS == *sweep* ]]; then
  timeout ${SWEEP_TIMEOUT:-420} python3 bench/w8a8_sweep.py --out $OUT/w8a8_sweep_${LABEL}.json --parts ${KINDS:-int8,fp8} \
    --ms ${MS:-1024,256,4096} --budget ${BUDGET:-380} 2>&1 | grep -E "best|WRONG|Error|budget" | tail -40
fi
if [[ $PARTS == *quant* ]]; then
  timeout 300 python3 -m pytest tests_gpu/quant -q -x > $OUT/tests_gpu_quant_${LABEL}.txt 2>&1
  tail -3 $OUT/tests_gpu_quant_${LABEL}.txt
fi
if [[ $PARTS == *gemm* ]]; then
  timeout 200 python3 -m quarl bench gemm --models qwen2.5-7b --shapes modules,engine --out $OUT/gemm_${LABEL}.json 2>&1 | tail -12
fi
if [[ $PARTS == *b7* ]]; then
  timeout 200 python3 -m quarl.cli.bench_rollout --shape qwen2.5-7b --batch 64 --prompt-len 256 --gen-len 1024 \
    --formats bf16,w4a16,w8a8-fp8,w8a8-int8 --out $OUT/rollout_7b_b64_${LABEL}.json 2>&1 | tail -8
fi
