"""``quarl export``'s work: pick the checkpoint, write the chosen format into a temporary
directory beside ``--out``, and rename it into place (a crash leaves ``--out`` as it was)."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quarl.export.hf import (
    METADATA_FILE, copy_tokenizer, engine_scheme, export_hf, export_metadata, find_checkpoint, read_policy,
)
from quarl.export.lora import export_merged, export_peft, is_lora
from quarl.export.packed import export_packed
from quarl.io import replace_dir
from quarl.model.loading import normal_permissions

FORMATS = ("hf-bf16", "hf-fp32", "quarl-packed", "compressed-tensors", "peft")
LOW_BIT = ("quarl-packed", "compressed-tensors")  # formats that quantize (and take --scheme)


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    format: str
    copied: list[str] = field(default_factory=list)  # tokenizer files taken from the model dir


def export_checkpoint(
    src: str | Path, out: str | Path, fmt: str = "hf-bf16", step: int | None = None, scheme: str | None = None,
    force: bool = False,
) -> ExportResult:
    """Export the policy of ``src`` (run dir or checkpoint dir) into ``out`` in format ``fmt``.

    ``scheme`` (low-bit formats only) overrides the run's ``quant.scheme``. A non-empty
    ``out`` is replaced only with ``force``. The export is written into a temporary
    directory beside ``out`` and renamed into place at the end, so a crash leaves
    ``out`` as it was.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if scheme is not None and fmt not in LOW_BIT:
        raise ValueError(f"--scheme applies to --format {' / '.join(LOW_BIT)} only")
    out = Path(out)
    _check_out(out, force)
    ckpt = read_policy(find_checkpoint(src, step))
    if ckpt.model_dir is not None and out.resolve() == ckpt.model_dir.resolve():
        raise ValueError(f"--out {out} is the run's own model.path; pick another directory")
    lora = is_lora(ckpt)
    if lora and fmt in LOW_BIT:
        raise ValueError(f"{ckpt.path} is a LoRA run's checkpoint: export it as --format peft (the adapters) or "
                         f"hf-bf16 / hf-fp32 (merged into the base), not {fmt}")
    if fmt == "peft" and not lora:
        raise ValueError(f"{ckpt.path} is a full fine-tune (model.lora_rank=0): there are no adapters to export "
                         "as peft; use --format hf-bf16")
    weights_scheme = engine_scheme(ckpt, scheme, fmt) if fmt in LOW_BIT else None
    if fmt == "compressed-tensors":
        from quarl.export.compressed import quantization_scheme

        quantization_scheme(weights_scheme)  # refuse unexportable schemes before any work
    uaq = {"quarl-packed": "applied", "compressed-tensors": "folded"}.get(fmt, "removed")
    metadata = export_metadata(ckpt, fmt, weights_scheme, uaq)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if fmt == "quarl-packed":
            export_packed(ckpt, tmp, weights_scheme, metadata)
        elif fmt == "compressed-tensors":
            from quarl.export.compressed import export_compressed

            export_compressed(ckpt, tmp, weights_scheme, metadata)
        elif fmt == "peft":
            export_peft(ckpt, tmp, metadata)
        elif lora:
            export_merged(ckpt, tmp, torch.bfloat16 if fmt == "hf-bf16" else torch.float32, metadata)
        else:
            export_hf(ckpt, tmp, torch.bfloat16 if fmt == "hf-bf16" else torch.float32, metadata)
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2, default=str))
        copied = copy_tokenizer(ckpt, tmp)
        normal_permissions(tmp)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, ckpt.path, ckpt.step, fmt, copied)


def _run_files(d: Path, config: bool = True) -> list[str]:
    """What makes ``d`` hold a training run (the files ``trainer.resume.existing_run`` looks at,
    and the config.yaml a resume reads; ``config=False`` leaves that out): empty when none."""
    names = ("metrics.jsonl", "config.yaml") if config else ("metrics.jsonl",)
    found = [name for name in names if (d / name).is_file()]
    return found + (["checkpoints/"] if (d / "checkpoints").is_dir() else [])


def _check_not_a_run(out: Path, force: bool) -> None:
    """Refuse an ``--out`` that is a run directory, lies inside one, or (``--force``) holds one
    below it: the export replaces ``--out`` whole, so any of these would delete run files, and
    ``--force`` must not make that possible. An ancestor's lone config.yaml is a user's run config
    beside their exports, not a run: only metrics or checkpoints make an ancestor a run."""
    target = out.resolve()
    for d in (target, *target.parents):
        found = _run_files(d, config=d == target)
        if found:
            where = "is" if d == target else "is inside"
            raise ValueError(f"--out {out} {where} the run directory {d} (it holds {', '.join(found)}): exporting "
                             f"there would replace the run's files, --force or not; pick a directory outside any "
                             f"run, e.g. --out {d.parent / (d.name + '-export')}")
    if not (force and target.is_dir()):
        return  # without --force a non-empty --out is refused anyway: no need to walk it
    for sub in sorted(p for p in target.rglob("*") if p.is_dir() and not p.is_symlink()):
        found = _run_files(sub)
        if found:
            raise ValueError(f"--out {out} holds the run directory {sub} (it holds {', '.join(found)}): "
                             "--force would delete that run; pick a new or empty directory")


def _check_out(out: Path, force: bool) -> None:
    _check_not_a_run(out, force)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace its contents, or pick a new directory")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (empty, or replaced under --force) goes only after."""
    replace_dir(tmp, out)
