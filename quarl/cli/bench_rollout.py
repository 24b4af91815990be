"""``quarl bench rollout``: engine throughput on random weights vs its floor and HF generate;
``--profile-kernels``: the decode step's kernels by GPU time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("rollout", help="rollout engine throughput (random weights, forced length)")
    _add_args(p)
    p.set_defaults(run=run)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    from quarl.bench.rollout import SHAPES

    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--batch", type=_batches, default=[256],
                   help="sequences decoded together; a comma list (e.g. 64,256) runs every format at each")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=1024)
    p.add_argument("--formats", default="bf16",
                   help="comma list: bf16,w8a8-fp8,w8a8-int8,w4a16,...; a format ending in +exact (e.g. w4a16+exact) "
                        "runs the engine in exact mode (quant.exact: the batch-invariant kernels)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma list of KV-cache dtypes: auto (the model dtype), fp8 (e4m3 + per-token scales); "
                        "each format runs with each")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="run the engine a LoRA run builds: the base in each format plus rank-r adapters on every "
                        "default target (0: no adapters)")
    p.add_argument("--dependent-launches", choices=("off", "on"), default="on",
                   help="the engine's decode kernels as programmatic dependent launches (Hopper+; "
                        "EngineConfig.dependent_launches)")
    p.add_argument("--dense-weights", choices=("auto", "on", "off"), default="auto",
                   help="whether a weight-only engine keeps dense bf16 copies of its weights and runs cuBLAS on them "
                        "where that wins (EngineConfig.dense_weights; auto: when they take at most 10%% of the GPU); "
                        "off times the quantized kernels at every batch")
    p.add_argument("--hf-gen-len", type=int, default=0,
                   help="also time HF generate with this many new tokens (0: skip)")
    p.add_argument("--baseline", metavar="DIR",
                   help="a directory holding another version's quarl/ package (e.g. `git archive REV quarl | tar -x "
                   "-C DIR`): every format then runs in a fresh process under this code and right after under that "
                   "code, and the table gives the speedups over it (old and new measured in one call)")
    p.add_argument("--baseline-commit", metavar="SHA", help="the baseline's commit, recorded in the result")
    p.add_argument("--out", default=None, help="write the JSON result here (--profile-kernels: the table, as text)")
    p.add_argument("--profile-kernels", action="store_true",
                   help="instead of throughput: per-kernel GPU time of one decode step (torch.profiler over replays "
                        "of the largest decode graph), one table per format")


def _batches(text: str) -> list[int]:
    """``--batch``: one or more positive integers, comma separated."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch takes integers separated by commas (e.g. 64,256), got {text!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--batch takes positive integers (e.g. 64,256), got {text!r}")
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from quarl.bench.rollout import profile_kernels, run_benchmark, summary_table
    from quarl.quant.kv import check_kv_cache_dtype

    kv_dtypes = tuple(check_kv_cache_dtype(k) for k in args.kv_cache_dtype.split(",") if k)
    if args.baseline and args.profile_kernels:
        raise ValueError("--baseline and --profile-kernels do not combine: profile one version at a time")
    if args.baseline:
        from quarl.bench.common import check_baseline

        check_baseline(Path(args.baseline))
    if not torch.cuda.is_available():
        raise ValueError("quarl bench rollout needs a CUDA GPU; run it on a GPU machine")
    engine_kw = {"dependent_launches": args.dependent_launches == "on", "dense_weights": args.dense_weights}
    if args.profile_kernels:
        text = "\n".join(profile_kernels(args.shape, f, b, args.prompt_len, kv_cache_dtype=kv,
                                         lora_rank=args.lora_rank, engine_kw=engine_kw)
                         for b in args.batch for f in args.formats.split(",") if f for kv in kv_dtypes)
        print(text)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
        return 0
    result = run_benchmark(
        args.shape, args.batch, args.prompt_len, args.gen_len, [f for f in args.formats.split(",") if f],
        hf_gen_len=args.hf_gen_len, out=args.out, kv_cache_dtypes=kv_dtypes, lora_rank=args.lora_rank,
        engine_kw=engine_kw, baseline=Path(args.baseline) if args.baseline else None,
        baseline_commit=args.baseline_commit,
    )
    print(summary_table(result))
    if not args.out:
        print(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quarl bench rollout", description=__doc__)
    _add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
