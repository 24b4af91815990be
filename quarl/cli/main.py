"""``quarl`` command line: thin entry points, no logic of their own."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import io
import os
import signal
import sys

# Subcommands live in their own modules, each with add_parser(subparsers) and run(args).
COMMANDS = ("train", "eval", "generate", "bench", "export", "report", "suite")
# Import name -> package of the optional dependencies in the "train" extra (pyproject.toml).
OPTIONAL = {
    "transformers": "transformers", "rich": "rich", "tensorboard": "tensorboard", "math_verify": "math-verify",
    "matplotlib": "matplotlib", "pyarrow": "pyarrow", "compressed_tensors": "compressed-tensors",
}
# Import name -> (package, extra) of what only some commands need: triton runs the GPU kernels that
# `quarl bench` times; the CPU torch wheel and the "train" extra leave it out.
OPTIONAL_ELSEWHERE = {"triton": ("triton", "triton")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quarl",
        description="RL for LLMs with low-precision rollouts and a rollout-aligned learner (QaRL).",
    )
    parser.add_argument("--version", action="version", version=f"quarl {__import__('quarl').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"quarl.cli.{name}").add_parser(sub)
    return parser


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's Python stack on stderr (a hung rank says
    where); not where stderr has no file descriptor to write to (an embedding host's)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if rest and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    _stacks_on_sigusr1()
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:  # user errors: one line, no traceback
        if getattr(args, "debug", False):
            raise
        message = str(e)
        if isinstance(e, ModuleNotFoundError):
            message = _install_hint(e)
        rank, local = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        if rank == "0":
            print(f"quarl {args.command}: error: {message}", file=sys.stderr)
        elif local == "0":  # (every rank meets the same setting's error: one line per node, not per rank)
            print(f"quarl {args.command} (rank {rank}, first of its node): error: {message}", file=sys.stderr)
        return 2


def _install_hint(e: ModuleNotFoundError) -> str:
    """The one-line install command for a missing optional package; re-raises anything else."""
    top = (e.name or "").split(".")[0]
    package, extra = (OPTIONAL[top], "train") if top in OPTIONAL else OPTIONAL_ELSEWHERE.get(top, (None, None))
    if package is None:
        raise e  # not a missing optional dependency: a bug, keep its traceback
    return f'this needs the Python package {package}, which is not installed: pip install -e ".[{extra}]"'


if __name__ == "__main__":
    sys.exit(main())
