"""``quarl bench gemm``: bf16 vs every quantized format on real models' linear shapes.

Wired by the CLI as a ``bench`` subcommand through :func:`add_parser` / :func:`run`;
also runnable alone: ``python3 -m quarl.cli.bench_gemm --out bench/baselines/gemm_h100.json``.
``--moe qwen3-30b-a3b --tokens-per-expert 4,8,32,128,1024 --formats bf16,w4a16,w8a8-fp8`` times an MoE
preset's expert projections instead (grouped GEMMs; :func:`quarl.bench.gemm_moe.run_moe_benchmark`).
"""

from __future__ import annotations

import argparse


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from quarl.bench.gemm import DEFAULT_FORMATS, DEFAULT_MODELS, EXACT_FORMATS, M_VALUES, MODELS, SHAPE_SETS
    from quarl.bench.gemm_moe import MOE_FORMATS, MOE_MODELS, MOE_TOKENS_PER_EXPERT

    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M (tokens)")
    p.add_argument("--formats", default=None,
                   help=f"comma list of scheme names (default: {','.join(DEFAULT_FORMATS)}; "
                        f"with --moe: {','.join(MOE_FORMATS)}); exact mode's batch-invariant GEMMs: "
                        f"{','.join(EXACT_FORMATS)}")
    p.add_argument("--shapes", default=",".join(SHAPE_SETS),
                   help="comma list of shape sets: modules (q, k, v, o, gate, up, down apart), "
                        "engine (q/k/v and gate/up fused, as the rollout engine runs them)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement (median)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--power", default="burst,sustained",
                   help="comma list of power states to time in: burst (right after a cool-down, clocks free), "
                        "sustained (after 0.5 s of the same load: the power cap's steady state), found (as it comes)")
    p.add_argument("--moe", default=None,
                   help=f"comma list of MoE presets ({', '.join(MOE_MODELS)}): time their expert projections "
                        "(bf16 grouped_mm, dequantize + grouped_mm, the grouped kernel) instead of --models")
    p.add_argument("--tokens-per-expert", default=",".join(map(str, MOE_TOKENS_PER_EXPERT)),
                   help="with --moe: comma list of rows per expert (every expert reached)")
    p.add_argument("--moe-tiles", action="store_true",
                   help="with --moe: also time the grouped kernel at each candidate tile "
                        "(quarl.quant.kernels.moe_gemm.TILE_CANDIDATES; methods kernel@BMxBN/w/s, T: swapped operands)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p


def _moe_models(spec: str) -> list[str]:
    from quarl.bench.gemm_moe import MOE_MODELS

    models = [x for x in spec.split(",") if x]
    bad = [x for x in models if x not in MOE_MODELS]
    if bad or not models:
        raise ValueError(f"--moe: unknown MoE preset(s) {bad or spec!r}; valid: {', '.join(MOE_MODELS)}")
    return models


def _formats(args: argparse.Namespace) -> list[str]:
    from quarl.bench.gemm import ALL_FORMATS, DEFAULT_FORMATS, EXACT_FORMATS
    from quarl.bench.gemm_moe import MOE_FORMATS, moe_methods

    if args.formats is None:
        return list(MOE_FORMATS if args.moe else DEFAULT_FORMATS)
    formats = [x for x in args.formats.split(",") if x]
    bad = [x for x in formats if x not in ALL_FORMATS]
    if bad or not formats:
        raise ValueError(f"--formats: unknown scheme(s) {bad or args.formats!r}; valid: {', '.join(ALL_FORMATS)}")
    if args.moe and set(formats) & set(EXACT_FORMATS):
        raise ValueError("--moe times the grouped expert GEMMs; the +exact formats time exact mode's dense "
                         "invariant GEMMs: run them without --moe")
    if args.moe:
        for f in formats:
            moe_methods(f)  # (refuses what quantized experts refuse)
    return formats


def _shape_sets(spec: str) -> tuple[str, ...]:
    from quarl.bench.gemm import SHAPE_SETS

    sets = tuple(x for x in spec.split(",") if x)
    bad = [x for x in sets if x not in SHAPE_SETS]
    if bad or not sets:
        raise ValueError(f"--shapes: unknown shape set(s) {bad or spec!r}; valid: {', '.join(SHAPE_SETS)}")
    return sets


def _power_states(spec: str) -> tuple[str | None, ...]:
    from quarl.bench.timing import POWER_MODES

    states = tuple(x for x in spec.split(",") if x)
    bad = [x for x in states if x not in POWER_MODES + ("found",)]
    if bad or not states:
        raise ValueError(f"--power: unknown power state(s) {bad or spec!r}; "
                         f"valid: {', '.join(POWER_MODES + ('found',))}")
    return tuple(None if x == "found" else x for x in states)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gemm", help="benchmark quantized GEMMs against bf16")
    _configure(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from quarl.bench.gemm import format_table, run_benchmark, save
    from quarl.bench.gemm_moe import format_moe_table, run_moe_benchmark

    formats = _formats(args)
    moe = _moe_models(args.moe) if args.moe else None
    tokens = [int(t) for t in args.tokens_per_expert.split(",") if t]
    if moe and (not tokens or min(tokens) < 1):
        raise ValueError(f"--tokens-per-expert: positive integers, got {args.tokens_per_expert!r}")
    if not torch.cuda.is_available():
        raise ValueError("quarl bench gemm needs a CUDA GPU (it times the fast kernels); run it on a GPU machine")
    partial = args.out + ".partial" if args.out else None
    if moe:
        result = run_moe_benchmark(models=moe, tokens_per_expert=tokens, formats=formats, reps=args.reps,
                                   graph=not args.no_graph, partial_path=partial, power=_power_states(args.power),
                                   tiles=args.moe_tiles)
        print(format_moe_table(result))
    else:
        result = run_benchmark(
            models=args.models.split(","), ms=[int(m) for m in args.m.split(",")],
            formats=formats, reps=args.reps, graph=not args.no_graph,
            partial_path=partial, sets=_shape_sets(args.shapes), power=_power_states(args.power),
        )
        print(format_table(result))
    if args.out:
        save(result, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_configure(argparse.ArgumentParser(prog="quarl bench gemm", description=__doc__)).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
