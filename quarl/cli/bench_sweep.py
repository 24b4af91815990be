"""``quarl bench sweep FAMILY``: candidate kernel configs of one dispatch family, timed
against bf16 and the table's choice (GPU; the winners become rows of the dispatch tables)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    from quarl.bench.gemm import MODELS
    from quarl.bench.sweep import FAMILIES

    families = "\n".join(f"  {name:12s} {f.doc} (M {','.join(map(str, f.ms))})" for name, f in FAMILIES.items())
    p = subparsers.add_parser(
        "sweep", help="time candidate configs of one kernel family (behind the dispatch tables)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{__doc__}\n\nfamilies:\n{families}\n\n"
        "A candidate spec is [kernel:]values: the config's fields in order and/or field=value, a value may be a "
        "grid a|b|c; ';' or newlines separate candidates, '#' starts a comment. E.g. wgmma '2,4,blocks_per_sm=1|2'; "
        "fp8 'cublas:;tma:64,64,128,num_stages=5,waves=3'. --list prints a family's own candidates as specs.",
    )
    p.add_argument("family", choices=list(FAMILIES), metavar="FAMILY", help=", ".join(FAMILIES))
    p.add_argument("--m", help="comma list of M (tokens); default: the family's")
    p.add_argument("--model", choices=list(MODELS), default="qwen2.5-7b", help="whose linear shapes")
    p.add_argument("--shapes", default="engine",
                   help="comma list of shape sets (engine: as the rollout engine runs them, modules: the checkpoint's "
                        "linears) and/or NxK items")
    p.add_argument("--candidates", help="candidate specs, or @FILE with one spec a line; default: the family's list")
    p.add_argument("--format", help="scheme of the operands (default: the family's)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds; no new shape starts after (default 300)")
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement (median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every plan this many times, in turn over the plans, and keep each one's fastest "
                        "(a drift of the clocks then hits all plans alike; default 1)")
    p.add_argument("--power", choices=("burst", "sustained"),
                   help="time every plan in this power state (burst: right after a cool-down; sustained: after "
                        "0.5 s of the same load); default: as found")
    p.add_argument("--once", action="store_true",
                   help="run each candidate once at each M and shape, untimed (for ncu / nsys); needs --candidates")
    p.add_argument("--trace", action="store_true",
                   help="wgmma plans only: run each candidate (default: the table's plan) once with the kernel's "
                        "timing probes and report per-block phases (fill, main loop, epilogue) and SM idle time")
    p.add_argument("--list", action="store_true", help="print the candidates at each M as specs and exit (no GPU)")
    p.add_argument("--out", help="write the JSON result here (rows, summary, device, commit)")
    p.add_argument("--against", metavar="FILE[,FILE]",
                   help="no GPU: replay the dispatch tables as they are now over saved sweeps of FAMILY (JSON from "
                        "--out): per M and shape the plan picked then and now, their times there and the fastest")
    p.add_argument("--gen", choices=("sm90", "sm89", "sm80"),
                   help="with --against: the w4a16 row set (default: from the sweep's device name)")
    p.set_defaults(run=run)
    return p


def _candidates(family: str, spec: str | None):
    from quarl.bench.sweep import parse_candidates

    if spec is None:
        return None
    if spec.startswith("@"):
        spec = Path(spec[1:]).read_text()
    return parse_candidates(family, spec)


def _check_format(family: str, fmt: str | None) -> None:
    from quarl.bench.sweep import family as get_family
    from quarl.quant.kernels import dispatch
    from quarl.quant.scheme import get_scheme

    fam = get_family(family)
    if fmt is None:
        return
    sc = get_scheme(fmt)
    table = "act_quant" if sc.act_format in ("fp8", "int8") and fam.table == "act_quant" else dispatch.family(sc)
    if fam.table.startswith("gated_"):
        table = "gated_" + str(sc.act_format)
    if table != fam.table:
        raise ValueError(f"--format {fmt}: its GEMM is picked from table {table}, "
                         f"family {family} overrides {fam.table}")


def _against(args: argparse.Namespace) -> int:
    from quarl.bench.sweep import against_lines, against_table

    for path in args.against.split(","):
        try:
            result = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"--against {path}: no such file (a sweep's JSON, written by --out)") from None
        if result.get("benchmark") != "sweep" or "rows" not in result:
            raise ValueError(f"--against {path}: not a sweep result "
                             "(no 'rows'; write one with quarl bench sweep --out)")
        if result["family"] != args.family:
            raise ValueError(f"--against {path}: a sweep of family {result['family']}, not {args.family}")
        print(f"{path} ({result.get('device', '?')}, {str(result.get('git_commit', '?'))[:8]}):")
        print("\n".join(against_lines(against_table(result, args.gen))))
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    from quarl.bench.common import write_json
    from quarl.bench.sweep import family, format_candidate, parse_shapes, run_once, run_sweep, run_trace

    if args.against:
        return _against(args)
    fam = family(args.family)
    cands = _candidates(args.family, args.candidates)
    ms = [int(m) for m in args.m.split(",")] if args.m else list(fam.ms)
    shapes = parse_shapes(args.shapes, args.model)
    _check_format(args.family, args.format)
    if args.list:
        for m in ms:
            print(f"M={m}:\n" + "\n".join(f"  {format_candidate(c)}" for c in (cands or fam.candidates(m))))
        return 0
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: time each plan at least once (--rounds 1 or more)")
    if args.once and cands is None:
        raise ValueError("--once runs the given candidates: pass --candidates SPEC")
    if args.trace and (args.once or fam.table != "w4a16"):
        raise ValueError("--trace probes the w4a16 wgmma kernel: a family of table w4a16 (wgmma, mid), without --once")
    if not torch.cuda.is_available():
        raise ValueError("quarl bench sweep needs a CUDA GPU (it times the kernels); run it on a GPU machine")
    if args.once:
        run_once(args.family, ms, shapes, cands, args.format, log=lambda s: print(s, flush=True))
        return 0

    def save(result: dict, path: str | None = args.out) -> None:
        write_json(result, path, indent=1)

    if args.trace:
        save(run_trace(args.family, ms, shapes, cands, args.format, log=lambda s: print(s, flush=True)))
        return 0

    result = run_sweep(args.family, ms, shapes, cands, args.format, args.budget, args.reps,
                       log=lambda s: print(s, flush=True), save=save, rounds=args.rounds, power=args.power)
    save(result)
    return 0
