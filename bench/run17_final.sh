set -u
export PYTHONPATH=.
timeout 330 python3 -m pytest tests_gpu/quant -q -x > $OUT/tests_gpu_quant_h100_run17.txt 2>&1
tail -3 $OUT/tests_gpu_quant_h100_run17.txt
