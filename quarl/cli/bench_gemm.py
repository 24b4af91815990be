"""``quarl bench gemm``: bf16 vs every quantized format on real models' linear shapes.

Wired by the CLI as a ``bench`` subcommand through :func:`add_parser` / :func:`run`;
also runnable alone: ``python3 -m quarl.cli.bench_gemm --out bench/baselines/gemm_h100.json``.
"""

from __future__ import annotations

import argparse


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from quarl.bench.gemm import ALL_FORMATS, DEFAULT_MODELS, M_VALUES, MODELS, SHAPE_SETS

    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma list of M (tokens)")
    p.add_argument("--formats", default=",".join(ALL_FORMATS), help="comma list of scheme names")
    p.add_argument("--shapes", default=",".join(SHAPE_SETS),
                   help="comma list of shape sets: modules (q, k, v, o, gate, up, down apart), "
                        "engine (q/k/v and gate/up fused, as the rollout engine runs them)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement (median)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--power", default="burst,sustained",
                   help="comma list of power states to time in: burst (right after a cool-down, clocks free), "
                        "sustained (after 0.5 s of the same load: the power cap's steady state), found (as it comes)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p


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

    if not torch.cuda.is_available():
        raise ValueError("quarl bench gemm needs a CUDA GPU (it times the fast kernels); run it on a GPU machine")
    result = run_benchmark(
        models=args.models.split(","), ms=[int(m) for m in args.m.split(",")],
        formats=args.formats.split(","), reps=args.reps, graph=not args.no_graph,
        partial_path=args.out + ".partial" if args.out else None, sets=_shape_sets(args.shapes),
        power=_power_states(args.power),
    )
    print(format_table(result))
    if args.out:
        save(result, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_configure(argparse.ArgumentParser(prog="quarl bench gemm", description=__doc__)).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
