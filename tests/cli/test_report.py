"""`quarl report` through the CLI: a run with no metrics yet keeps the report it has, and a
directory the report cannot be written into is a one-line error."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.cli.test_cli import _one_line_error, _quarl


def _run_dir(path: Path, steps: int = 3) -> Path:
    """A run directory as the trainer leaves one, as far as the report reads it."""
    path.mkdir(parents=True)
    rows = [{"step": s, "wall": 1.8e9 + s, "reward/mean": 0.1 * s, "acc/mean": 0.1 * s, "mismatch/kl_k3": 1e-13}
            for s in range(1, steps + 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_run_without_metrics_keeps_the_report_it_has(tmp_path):
    run = _run_dir(tmp_path / "run")
    assert _quarl("report", str(run)).stdout.strip() == str(run / "report.html")
    before = {k: v for k, v in _files(run).items() if k != "metrics.jsonl"}
    assert "report.html" in before and any(k.startswith("report_files/") for k in before)
    for text in ("", '{"step": 1, "rew'):  # emptied, or its one line cut by a crash
        (run / "metrics.jsonl").write_text(text)
        err = _one_line_error(_quarl("report", str(run), check=False), "report")
        assert err == (f"quarl report: error: {run / 'metrics.jsonl'} holds no metrics yet: nothing to report, and "
                       f"any report already there is kept; report {run} once it has logged a step\n")
        assert {k: v for k, v in _files(run).items() if k != "metrics.jsonl"} == before
    other = _run_dir(tmp_path / "other")
    err = _one_line_error(_quarl("report", str(other), str(run), check=False), "report")
    assert "(or leave it out of the comparison)" in err and not (other / "report-compare.html").exists()


def test_an_out_that_cannot_be_written_is_a_one_line_error(tmp_path):
    run = _run_dir(tmp_path / "run")
    out = run / "metrics.jsonl" / "report"  # under a regular file
    err = _one_line_error(_quarl("report", str(run), "--out", str(out), check=False), "report")
    assert err.startswith(f"quarl report: error: cannot write the report into {out}: ")
    assert err.endswith("; pass --out DIR to write it into a writable directory\n") and len(err.splitlines()) == 1


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_read_only_run_directory_is_a_one_line_error(tmp_path, monkeypatch, capsys, code):
    """As root no permission bit stops a write: the OS's refusal is simulated for every directory
    made under the run (the report's figures go first), through the CLI's own entry point."""
    from quarl.cli.main import main

    run = _run_dir(tmp_path / "run")
    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):
        if run in self.parents and not self.exists():
            raise OSError(code, os.strerror(code), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err == (f"quarl report: error: cannot write the report into {run}: "
                                       f"{os.strerror(code)}: {run / 'report_files'}; pass --out DIR to write it "
                                       "into a writable directory\n")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_metrics_that_cannot_be_read_are_a_read_error_not_a_write_one(tmp_path, monkeypatch, capsys):
    from quarl.cli.main import main

    run = _run_dir(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    read_text = Path.read_text

    def refuse(self, *args, **kwargs):
        if self == metrics:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    assert main(["report", str(run)]) == 2
    assert capsys.readouterr().err == f"quarl report: error: cannot read {metrics}: {os.strerror(errno.EACCES)}\n"
