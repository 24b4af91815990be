"""Argument groups and loaders shared by the subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from quarl.runtime import resolve_device, resolve_dtype


def add_common_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local HF checkpoint directory (default: the built-in random model)")
    p.add_argument("--builtin", default="tiny", help="built-in model preset when --model is not given")
    p.add_argument("--tokenizer", help="local tokenizer directory (default: the model's, or the built-in one)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")


def load_model_and_tokenizer(args: argparse.Namespace, scheme=None):
    """The model and tokenizer named by the common arguments, on the chosen device. With a
    low-bit ``scheme`` a checkpoint's decoder linears are quantized as they load, one at a time
    (``load_quantized_model``), so a model whose bf16 weights do not fit the device still runs."""
    import quarl
    from quarl.model.presets import build_random_model
    from quarl.tasks.tokenizer import load_tokenizer

    _check_dirs(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model and scheme is not None and scheme.quantizes_weights:
        from quarl.model.quantized_loading import load_quantized_model

        model = load_quantized_model(args.model, scheme, dtype=dtype, device=device)
        tok_dir = args.tokenizer or (args.model if _has_tokenizer(args.model) else None)
    elif args.model:
        model = quarl.load_model(args.model, dtype=dtype, device=device)
        tok_dir = args.tokenizer or (args.model if _has_tokenizer(args.model) else None)
    else:
        model = build_random_model(args.builtin, dtype=dtype, device=device)
        tok_dir = args.tokenizer
    tok = load_tokenizer(tok_dir)
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}; "
            "pass the tokenizer that belongs to this model with --tokenizer"
        )
    return model, tok, device


def _check_dirs(args: argparse.Namespace) -> None:
    """``--model`` and ``--tokenizer`` exist and hold what they name, in this command's flags (the
    loaders' own messages name the run config's settings)."""
    if args.model and not Path(args.model).exists():
        raise FileNotFoundError(f"--model {args.model} does not exist: pass a local Hugging Face model directory "
                                "(config.json + *.safetensors), or leave --model out for the built-in random model")
    if args.tokenizer in (None, "builtin"):
        return
    if not Path(args.tokenizer).exists():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer} does not exist: pass a local tokenizer (or model) "
                                "directory, or leave --tokenizer out for the model's own")
    if not _has_tokenizer(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer {args.tokenizer} has no tokenizer files (tokenizer.json / "
                                "tokenizer_config.json): pass the model's tokenizer directory, or --tokenizer builtin "
                                "for the built-in character tokenizer")


def _has_tokenizer(path: str) -> bool:
    p = Path(path)
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def os_error(e: OSError, writes_under: Path | None, what: str = "", fix: str = "") -> ValueError:
    """A one-line error for an ``OSError`` that the OS raised on ``e.filename`` (a read-only or
    full disk, a file where a directory should be, no permission): a failed write when the path
    lies under ``writes_under`` (``fix`` then says where else to write), else a failed read."""
    path = Path(e.filename).resolve()
    reason = e.strerror or type(e).__name__
    root = writes_under.resolve() if writes_under is not None else None
    if root is not None and (path == root or root in path.parents):
        return ValueError(f"cannot write {what}: {reason}: {e.filename}; {fix}")
    return ValueError(f"cannot read {e.filename}: {reason}")
