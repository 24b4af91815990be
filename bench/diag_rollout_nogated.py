"""The rollout bench with the gated gate/up GEMM switched off (diagnosis)."""
import sys
from quarl.quant import ops
ops.gated_silu_quantized_input = lambda *a, **k: None
from quarl.cli.bench_rollout import main
sys.exit(main())
