#!/bin/bash
# Run 9 device call: a smoke check of the CUDA fragment kernel, the quant GPU suite, the w4
# sweep (frag warps x K split at M <= 16), then the GEMM bench with the sweep's best config
# (if it beats the default by > 2%).
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
python3 - > $OUT/smoke.txt 2>&1 <<'PY'
import torch, time
from quarl.quant import quantize_weight, reference_linear
from quarl.quant.kernels import cuda_w4, launch
print("torch", torch.__version__, "compile_kernel", hasattr(torch.cuda, "_compile_kernel"), "available", cuda_w4.available())
for name in ("w4a16", "w4a16-asym"):
    qw = quantize_weight(torch.randn(3584, 3584, device="cuda") * 0.02, name)
    x = torch.randn(16, 3584, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    y = cuda_w4.w4a16_frag_gemm(x, qw, None, counters=launch._counters)
    torch.cuda.synchronize()
    e = reference_linear(x.float(), qw, exact=True)
    print(name, "first call (compile) %.2fs" % (time.time() - t0), "rel err", float((y.float() - e).norm() / e.norm()))
PY
cat $OUT/smoke.txt; grep -q "rel err" $OUT/smoke.txt || exit 1
timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests_gpu/quant -q -x -p no:cacheprovider -k "frag" > $OUT/tests_frag.txt 2>&1
tail -5 $OUT/tests_frag.txt
timeout $(( ${SWEEP_BUDGET:-120} + 60 )) python3 bench/gemm_sweep.py --kinds w4 --budget ${SWEEP_BUDGET:-120} --out $OUT/sweep.json > $OUT/sweep.txt 2>&1
python3 bench/gemm_pick_w4.py $OUT/sweep.json > $OUT/pick.sh 2> $OUT/pick.txt
. $OUT/pick.sh
grep -v "^ \|Error\|WRONG" $OUT/sweep.txt | tail -12; cat $OUT/pick.sh $OUT/pick.txt
timeout ${BENCH_TIMEOUT:-150} python3 -m quarl.cli.bench_gemm --reps 15 --models ${MODELS:-qwen2.5-7b,qwen2.5-1.5b} --m 1,16,64 --formats bf16,w4a16,w4a16-asym --out $OUT/gemm_small.json > $OUT/gemm_small.txt 2>&1
grep "M=" $OUT/gemm_small.txt | cut -c1-120; tail -3 $OUT/gemm_small.txt
