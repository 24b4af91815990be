"""The rollout bench with lookahead scheduling switched off (run-14 A/B: every decode step
is scheduled and its inputs filled after the previous one finished, as before).

    PYTHONPATH=. python3 bench/diag_rollout_nolookahead.py --shape qwen2.5-7b --batch 64 \
        --prompt-len 256 --gen-len 1024 --formats bf16,w8a8-fp8 --out $OUT/nolookahead.json
"""

import sys
from dataclasses import dataclass

from quarl.rollout import bench


@dataclass
class _NoLookahead(bench.EngineConfig):
    lookahead: bool = False


bench.EngineConfig = _NoLookahead

from quarl.cli.bench_rollout import main  # noqa: E402 - after the switch

sys.exit(main())
