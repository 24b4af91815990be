"""(Provenance of dispatch_decisions.json; ran once against the dispatch written as predicates
in code, before its rows became data.) Records ``dispatch.lookup`` for every table, GPU
generation and dense flag over a grid of shapes: every N and K a model of the tables' sizes
has, the values on both sides of each threshold the old predicates compared against, the
weight sizes on both sides of 2^25, 2^26 and 2^27 elements, and M at every row boundary and
tile-count step (the decisions are constant in M between those).

Usage: ``python tests/quant/data/capture_dispatch_decisions.py > tests/quant/data/dispatch_decisions.json``
"""

import json
import random
import sys

from quarl.quant.kernels import dispatch


def m_grid() -> list[int]:
    steps = {1, 2, 3, 4, 8, 16, 32, 64, 127, 128, 256, 384, 512, 768, 1024, 2047, 4096}
    steps |= {b * j for b in (64, 128, 192) for j in range(1, 1024 // b + 2)}
    return sorted({v for s in steps for v in (s, s + 1)})


NS = [64, 256, 512, 896, 1000, 1152, 1536, 2047, 2048, 2049, 2560, 3584, 4096, 4608, 5119, 5120, 6144, 7168,
      8192, 8960, 9728, 11008, 12288, 13824, 14336, 16320, 16321, 16383, 16384, 17920, 18944, 22016, 25344,
      25345, 27648, 28672, 32767, 32768, 33792, 33793, 37888, 55296]
KS = [256, 896, 1040, 1536, 2047, 2048, 2049, 3584, 4096, 4097, 4864, 5119, 5120, 8191, 8192, 8193, 8960,
      11008, 12288, 13824, 13825, 14336, 18944, 27648]


def nk_grid() -> list[tuple[int, int]]:
    pairs = {(n, k) for n in NS for k in KS}
    for k in (1536, 3584, 5120, 8193, 13824):  # weights on both sides of 2^25, 2^26, 2^27 elements
        for t in (1 << 25, 1 << 26, 1 << 27):
            n = -(-t // k)
            pairs |= {(n, k), (n - 1, k)}
    rng = random.Random(0)
    pairs |= {(16 * rng.randint(1, 4000), 16 * rng.randint(1, 2000)) for _ in range(40)}
    return sorted(pairs)


def encode(plan) -> list | None:
    if plan is None:
        return None
    cfg = plan.config
    return [plan.kernel, None if cfg is None else type(cfg).__name__, None if cfg is None else list(cfg)]


def columns() -> list[tuple[str, str, bool]]:
    cols = [("w4a16", gen, dense) for gen in dispatch.GENS for dense in (False, True)]
    cols += [("gated_w4a16", gen, False) for gen in dispatch.GENS]
    cols += [(fam, "none", False) for fam in ("weight_only", "fp8", "int8", "w4a8", "gated_fp8", "gated_int8")]
    return cols


def main() -> None:
    ms, pairs, cols = m_grid(), nk_grid(), columns()
    plans: list = []
    runs: list = []  # distinct run-length lists over ms: [[plan index, count], ...]
    index_of_plan: dict = {}
    index_of_run: dict = {}
    table = []
    for n, k in pairs:
        row = [n, k]
        for fam, gen, dense in cols:
            seq = []
            for m in ms:
                key = json.dumps(encode(dispatch.lookup.__wrapped__(fam, gen, m, n, k, dense)))
                i = index_of_plan.setdefault(key, len(plans))
                if i == len(plans):
                    plans.append(json.loads(key))
                if seq and seq[-1][0] == i:
                    seq[-1][1] += 1
                else:
                    seq.append([i, 1])
            rkey = json.dumps(seq)
            j = index_of_run.setdefault(rkey, len(runs))
            if j == len(runs):
                runs.append(seq)
            row.append(j)
        table.append(row)
    out = {"about": "dispatch.lookup(family, gen, m, n, k, dense) before the tables became data: for each "
                    "[n, k, *run index per column], runs[i] lists [plan index, how many consecutive ms] over ms",
           "ms": ms, "columns": cols, "plans": plans, "runs": runs, "shapes": table}
    sys.stdout.write("{\n" + ",\n".join(f"{json.dumps(key)}: {json.dumps(v)}" for key, v in out.items()) + "\n}\n")


if __name__ == "__main__":
    main()
