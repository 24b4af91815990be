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


def _has_tokenizer(path: str) -> bool:
    p = Path(path)
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
