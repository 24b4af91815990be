"""The rollout bench with the gated gate/up GEMM switched off (run-13 diagnosis: the engine's
W8A8 MLP then runs the plain GEMM + SiLU-and-mul + partials quantizer at every batch size).

    PYTHONPATH=. python3 bench/diag_rollout_nogated.py --shape qwen2.5-7b --batch 64 \
        --prompt-len 256 --gen-len 1024 --formats w8a8-fp8 --out $OUT/nogated.json
"""

import sys

from quarl.quant import ops

ops.gated_silu_quantized_input = lambda *a, **k: None

from quarl.cli.bench_rollout import main  # noqa: E402 - after the switch

sys.exit(main())
