"""Where metrics go: ``metrics.jsonl`` always, TensorBoard and wandb when enabled.

``metrics.jsonl`` holds one JSON object per step with the metric names of docs/design.md (and
``wall``, the Unix time the row was written);
on resume, lines of steps past the checkpoint are dropped so the file reads as one
uninterrupted run. A crash can leave the last line cut short: readers skip such a
torn last line with a warning naming the file; a bad line anywhere else is an error.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from quarl.io import write_text_atomic


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        if resume_step is not None:
            truncate_after(self.path, resume_step)
            truncate_after(self.samples_path, resume_step)
        elif self.path.exists():  # never delete a run's history; the Trainer asks for --resume first
            raise ValueError(f"{self.path} already exists: pass --resume to continue that run")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: metrics.jsonl still has everything
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step)
        self.wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("trainer.wandb_project is set but wandb is not installed: pip install wandb") from e
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(self.run_dir), resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # "wall": when the row was written (Unix seconds; metrics.jsonl alone): where a run's time went
        row = {"step": step, "wall": round(time.time(), 3), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]], tag: str = "samples") -> None:
        """Append ``samples`` to ``samples.jsonl`` (and TensorBoard's text ``tag``). A row holds
        ``prompt``, ``completion``, ``answer``, ``reward``, ``error_kind`` / ``error_pos`` (the
        first error token, :mod:`quarl.trainer.error_tokens`) and, for a flagged training
        response, ``flagged``, ``response_tokens`` and ``error_text``."""
        with open(self.samples_path, "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")
        if self.tb is not None and samples:
            text = "\n\n".join(f"**prompt** `{s['prompt']}`  \n**completion** `{s['completion']}`  \n"
                               f"reward {s['reward']}{_error_note(s)}" for s in samples)
            self.tb.add_text(tag, text, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _error_note(sample: dict[str, Any]) -> str:
    if sample.get("error_pos") is None:
        return ""
    return f" · {sample.get('error_kind')} from response token {sample['error_pos']}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def warn_stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def read_jsonl(path: Path, warn: Callable[[str], None] = warn_stderr) -> list[dict[str, Any]]:
    """The rows of a JSONL file written by this logger.

    A last line that does not parse was cut by a crash mid-write: it is skipped with a
    warning. A bad line before the last cannot come from a crash, so it is an error
    naming the file and line (the file was edited or damaged).
    """
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                warn(f"{path}: skipping its last line, cut short by a crash ({line[:40]!r}...)")
                break
            raise ValueError(
                f"{path}, line {i + 1} is not a JSON object ({e}): the file was damaged or edited; "
                f"fix or delete that line"
            ) from e
        rows.append(row)
    return rows


def truncate_after(path: Path, step: int, warn: Callable[[str], None] = warn_stderr) -> None:
    """Keep the rows of ``path`` whose ``step`` is <= ``step`` (a torn last line goes too)."""
    if not path.exists():
        return
    keep = [row for row in read_jsonl(path, warn) if row.get("step", 0) <= step]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in keep))  # a crash must not lose the history


def read_metrics(run_dir: str | Path, warn: Callable[[str], None] = warn_stderr) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a quarl run directory?")
    return read_jsonl(path, warn)
