"""``quarl export``: a training checkpoint's policy as a HF, quarl-packed or compressed-tensors checkpoint dir."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from quarl.export.run import FORMATS

    p = sub.add_parser(
        "export",
        help="export a checkpoint's policy (HF bf16/fp32, or the engine's low-bit weights)",
        description="Export the policy of a run's latest checkpoint (or --step N, or a checkpoint dir). "
        "hf-bf16/hf-fp32 write a plain HF model (UAQ undone); quarl-packed writes the low-bit "
        "tensors of quant.scheme that the rollout engine ran on (load with quarl.export.load_packed); "
        "compressed-tensors writes the same codes in the format vLLM and transformers load "
        "(needs pip install compressed-tensors). A LoRA run (model.lora_rank > 0) exports as peft "
        "(adapter_config.json + adapter_model.safetensors) or hf-bf16/hf-fp32 with the adapters merged.",
    )
    p.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT", help="run directory or checkpoints/step_NNNNNN")
    p.add_argument("--out", required=True, help="output directory (new or empty; see --force)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.add_argument("--format", default="hf-bf16", choices=FORMATS)
    p.add_argument("--step", type=int, help="export this step's checkpoint instead of the latest")
    p.add_argument("--scheme", help="quarl-packed / compressed-tensors: quantize with this scheme instead of the "
                   "run's quant.scheme")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quarl.cli.common import os_error
    from quarl.export.run import export_checkpoint

    try:
        res = export_checkpoint(args.source, args.out, args.format, args.step, args.scheme, force=args.force)
    except OSError as e:
        if e.filename is None:  # the export's own messages (no such run, no checkpoint): as they are
            raise
        # the export is written beside --out, then renamed into place: a failure there is a write
        out = Path(args.out)
        raise os_error(e, out.absolute().parent, f"the export to {out}",
                       "pick a writable directory for --out") from None
    print(f"exported step {res.step} ({res.checkpoint}) as {res.format} to {res.out}")
    if res.copied:
        print(f"tokenizer files: {', '.join(res.copied)}")
    else:
        print("no tokenizer files copied (the run used no local tokenizer directory)")
    return 0
