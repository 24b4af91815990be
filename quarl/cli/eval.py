"""``quarl eval``: a run's checkpoint (or a model) on the task's eval split, or on local math sets.

Without ``--data``: greedy accuracy on the task's eval split, printed as JSON.
With ``--data FILE`` (repeatable): ``--n`` samples per problem, scored by the run's verifier
(or ``--reward``) in its timed reward pool, reported as pass@k and avg@K per set and overall
(``quarl.evaluation``), in one column per ``--scheme``; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run's latest checkpoint (or a model) on the eval split or on local data sets",
        description="Without --data: greedy accuracy on the task's eval split, as JSON. With --data: "
                    "pass@k and avg@K of --n samples per problem, per set and overall, per --scheme.",
    )
    p.add_argument("run_dir", nargs="?", help="a run directory (its config and latest checkpoint are used)")
    p.add_argument("--config", help="YAML run config with model.path set (to evaluate a model, not a run)")
    p.add_argument("--model", help="local HF checkpoint directory to evaluate as it is (sets model.path)")
    p.add_argument("--scheme", action="append",
                   help="engine quantization scheme(s), e.g. w4a16 or bf16,w4a16 side by side (default: the run's)")
    p.add_argument("--data", action="append", metavar="FILE",
                   help="a .jsonl or .parquet set with data.prompt_key / data.answer_key columns (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per problem (K of avg@K; default 1)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: 0 = greedy for --n 1, else 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (default 1 = none)")
    p.add_argument("--max-new-tokens", type=int, help="default: the run's rollout.max_new_tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same samples)")
    p.add_argument("--reward", help="verifier: builtin (the run's), math, or module:function")
    p.add_argument("--reward-timeout", type=float, help="seconds per item before a verifier call is cut off")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from quarl.trainer.eval_sets import EvalSettings, evaluate_sets

    schemes = [s.strip() for arg in args.scheme or [] for s in arg.split(",") if s.strip()]
    if not args.data:
        sampling = [f for f, v in (("--n", args.n != 1), ("--temperature", args.temperature is not None),
                                   ("--top-p", args.top_p != 1.0), ("--out", args.out)) if v]
        if sampling:
            verb = "need" if len(sampling) > 1 else "needs"
            raise ValueError(
                f"{', '.join(sampling)} {verb} --data (the eval split is scored greedily, as JSON on stdout)")
        if len(schemes) > 1:
            raise ValueError("several --scheme values need --data (the eval split reports one scheme)")
        return _with_config(args, schemes[0] if schemes else None, _evaluate_split)
    from quarl.rollout import SamplingParams
    from quarl.tasks import read_examples

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 1.0)
    SamplingParams(n=args.n, temperature=temperature, top_p=args.top_p)  # bad values fail before a model loads
    settings = EvalSettings(args.n, temperature, args.top_p, args.seed)
    names = [Path(f).stem for f in args.data]
    if len(set(names)) != len(names):
        raise ValueError(f"two --data files share a name ({', '.join(names)}): sets are named by file stem")
    # read every set before any model is built: a bad file fails in a second, with file and line
    probe = _load_config(args, None, [])
    sets = {name: read_examples(f, probe.data.prompt_key, probe.data.answer_key) for name, f in zip(names, args.data)}
    results: dict[str, dict] = {}
    for scheme in schemes or [None]:
        res = _with_config(args, scheme, lambda cfg, resume: evaluate_sets(cfg, resume, sets, settings, args.quiet))
        results[res["scheme"]] = res
    report = _report(results, args, settings)
    _print_table(results, settings.n)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"--model.path={args.model}")
    if args.reward:
        overrides.append(f"--data.reward={args.reward}")
    if args.reward_timeout is not None:
        overrides.append(f"--data.reward_timeout_s={args.reward_timeout}")
    if args.max_new_tokens is not None:
        overrides.append(f"--rollout.max_new_tokens={args.max_new_tokens}")
    return overrides + ["--trainer.tensorboard=false"]


def _load_config(args: argparse.Namespace, scheme: str | None, extra: list[str]):
    from quarl.config import load_run_config

    overrides = _overrides(args) + extra
    if scheme:
        base = _load_config(args, None, extra)
        if scheme != base.quant.scheme:  # the engine in that scheme, the weights as trained
            # (a LoRA run: its frozen base is packed in that scheme, its adapters added as trained)
            mode = "bf16" if scheme == "bf16" else "aligned" if base.model.lora_rank else "rollout"
            overrides += [f"--quant.scheme={scheme}", f"--quant.mode={mode}"]
    if args.run_dir:
        run_dir = Path(args.run_dir)
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{run_dir} has no config.yaml: is it a quarl run directory?")
        cfg = load_run_config(str(cfg_file), overrides + [f"--trainer.run_dir={run_dir}"])
    else:
        cfg = load_run_config(args.config, overrides + ["--trainer.sft_warmup_steps=0"])
        if not cfg.model.path:  # else: an untrained random model, whose score means nothing
            raise ValueError(
                "nothing to evaluate: pass a run directory (quarl eval RUN_DIR), or a model with "
                "quarl eval --config run.yaml where model.path is set (or --model DIR)"
            )
    if args.reward_timeout is not None and cfg.data.reward_workers == 0:
        # inline scoring (workers=0) has no timeout: a timeout asked for needs a worker process
        return _load_config(args, scheme, extra + ["--data.reward_workers=1"])
    return cfg


def _with_config(args: argparse.Namespace, scheme: str | None, evaluate):
    import tempfile

    if args.run_dir:
        return evaluate(_load_config(args, scheme, []), True)
    # A model as it is: no warm-start, and no run directory left behind.
    with tempfile.TemporaryDirectory(prefix="quarl-eval-") as scratch:
        return evaluate(_load_config(args, scheme, [f"--trainer.run_dir={scratch}"]), False)


def _evaluate_split(cfg, resume: bool) -> int:
    from quarl.trainer.evaluation import build_for_evaluation

    run = build_for_evaluation(cfg, resume)  # the engine, data and verifier: no learner
    try:
        metrics, _ = run.evaluation.run(run.policy)
    finally:
        run.rewards.close()
    metrics["step"] = run.step
    print(json.dumps(metrics, indent=2))
    return 0


def _report(results: dict[str, dict], args: argparse.Namespace, settings) -> dict:
    first = next(iter(results.values()))
    config = {
        "run_dir": args.run_dir, "model": args.model, "step": first["step"],
        "data": {name: str(Path(f)) for name, f in zip(first["sets"], args.data)},
        "n": settings.n, "temperature": settings.temperature, "top_p": settings.top_p, "seed": settings.seed,
        "reward": first["reward_spec"], "schemes": list(results),
    }
    strip = {name: {"sets": r["sets"], "overall": r["overall"]} for name, r in results.items()}
    if len(strip) == 1:
        return {**next(iter(strip.values())), "config": config}
    return {"schemes": strip, "config": config}


def _print_table(results: dict[str, dict], n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from quarl.evaluation import ks_up_to

    table = Table(title=f"quarl eval: {n} sample{'s' if n > 1 else ''} per problem")
    table.add_column("set")
    table.add_column("problems", justify="right")
    table.add_column("metric")
    for scheme in results:
        table.add_column(scheme, justify="right")
    first = next(iter(results.values()))
    rows = [(name, s["num_problems"]) for name, s in first["sets"].items()]
    if len(rows) > 1:
        rows.append(("overall", first["overall"]["num_problems"]))
    metrics = [f"avg@{n}"] + [f"pass@{k}" for k in ks_up_to(n)]
    for i, (name, count) in enumerate(rows):
        for j, metric in enumerate(metrics):
            cells = []
            for r in results.values():
                s = r["overall"] if name == "overall" else r["sets"][name]
                value = s[metric] if metric.startswith("avg") else s["pass@k"][metric[5:]]
                cells.append(f"{value:.3f}")
            table.add_row(name if j == 0 else "", str(count) if j == 0 else "", metric, *cells,
                          end_section=j == len(metrics) - 1 and i < len(rows) - 1)
    cut = {s: sum(v["reward_timeouts"] for v in r["sets"].values()) for s, r in results.items()}
    if any(cut.values()):
        table.caption = "verifier timeouts (scored 0): " + ", ".join(f"{s} {c}" for s, c in cut.items())
    Console().print(table)
