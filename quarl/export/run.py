"""``quarl export``'s work: pick the checkpoint, write the chosen format into a temporary
directory beside ``--out``, and rename it into place (a crash leaves ``--out`` as it was)."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quarl.export.hf import copy_tokenizer, export_hf, find_checkpoint, read_policy
from quarl.export.packed import export_packed
from quarl.model.loading import normal_permissions

FORMATS = ("hf-bf16", "hf-fp32", "quarl-packed")


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

    ``scheme`` (quarl-packed only) overrides the run's ``quant.scheme``. A non-empty
    ``out`` is replaced only with ``force``. The export is written into a temporary
    directory beside ``out`` and renamed into place at the end, so a crash leaves
    ``out`` as it was.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if scheme is not None and fmt != "quarl-packed":
        raise ValueError("--scheme applies to --format quarl-packed only")
    out = Path(out)
    _check_out(out, force)
    ckpt = read_policy(find_checkpoint(src, step))
    if ckpt.model_dir is not None and out.resolve() == ckpt.model_dir.resolve():
        raise ValueError(f"--out {out} is the run's own model.path; pick another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if fmt == "quarl-packed":
            export_packed(ckpt, tmp, scheme)
        else:
            export_hf(ckpt, tmp, torch.bfloat16 if fmt == "hf-bf16" else torch.float32)
        copied = copy_tokenizer(ckpt, tmp)
        normal_permissions(tmp)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, ckpt.path, ckpt.step, fmt, copied)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace its contents, or pick a new directory")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (empty, or replaced under --force) goes only after."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)
