"""`quarl export` through the CLI: refuses to overwrite, writes all or nothing, normal file modes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import quarl
from tests.export.test_export import _make_run, _original

ROOT = Path(__file__).resolve().parents[2]


def _export(*args):
    return subprocess.run([sys.executable, "-m", "quarl", "export", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _make_run(tmp_path_factory.mktemp("run"), _original(), mode="rollout")


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_export_has_normal_permissions_and_no_leftovers(run, tmp_path):
    out = tmp_path / "nested" / "hf"
    r = _export(run, "--out", out, "--format", "hf-fp32")
    assert r.returncode == 0, r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    for f in out.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, f  # 0644 under umask 022, not 0600
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no temporary directory left beside it
    quarl.load_model(out)


def test_non_empty_out_needs_force(run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = _export(run, "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--out {out} is not empty; pass --force" in r.stderr
    assert _tree(out) == {"notes.txt": b"mine"}
    assert _export(run, "--out", out, "--force").returncode == 0
    assert sorted(_tree(out)) == ["config.json", "model.safetensors", "quarl_export.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(run, "--out", empty).returncode == 0  # an empty directory is fine without --force


def test_failed_export_leaves_out_as_it_was(run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    r = _export(run, "--out", out, "--force", "--format", "quarl-packed")  # a rollout w4a16 run: this one works
    assert r.returncode == 0, r.stderr
    assert _tree(out) != before
    before = _tree(out)
    # the tiny model's K = 64 holds no whole group of 128: fails inside the export, its temporary dir made
    r = _export(run, "--out", out, "--force", "--format", "compressed-tensors")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "layers.0.self_attn.q_proj: in_features 64 is not a multiple" in r.stderr
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes): the run, to check it is untouched."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run_copy(run: Path, where: Path) -> Path:
    """A run directory as the trainer leaves one: checkpoints plus config.yaml and metrics.jsonl."""
    shutil.copytree(run, where)
    (where / "config.yaml").write_text("trainer:\n  steps: 3\n")
    (where / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    return where


@pytest.mark.parametrize("inside", ["", "checkpoints", "checkpoints/step_000003", "exports/hf"])
def test_export_refuses_to_write_into_the_run_even_with_force(run, tmp_path, inside):
    """`quarl export RUN --out RUN --force` used to delete the run's checkpoints, metrics and config."""
    src = _run_copy(run, tmp_path / "run")
    before = _snapshot(src)
    out = src / inside if inside else src
    r = _export(src, "--out", out, "--force")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    where = "is" if not inside else "is inside"
    assert f"quarl export: error: --out {out} {where} the run directory {src.resolve()}" in r.stderr
    assert "--force or not; pick a directory outside any run" in r.stderr
    assert _snapshot(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary directory left beside it


def test_export_refuses_a_directory_holding_a_run_and_a_run_written_by_hand(run, tmp_path):
    src = _run_copy(run, tmp_path / "runs" / "a")
    before = _snapshot(tmp_path / "runs")
    r = _export(src, "--out", tmp_path / "runs", "--force")  # --force would replace runs/ whole, runs/a with it
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--out {tmp_path / 'runs'} holds the run directory {(src).resolve()}" in r.stderr
    assert "--force would delete that run" in r.stderr
    assert _snapshot(tmp_path / "runs") == before
    other = tmp_path / "other-run"  # any directory with a run's files, not only the exported run's own
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    r = _export(src, "--out", other, "--force")
    assert r.returncode == 2 and f"--out {other} is the run directory {other.resolve()} (it holds metrics.jsonl)" \
        in r.stderr, r.stderr
    assert (other / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # beside a run config of the user's own (config.yaml in the parent, no metrics or checkpoints): fine
    (tmp_path / "config.yaml").write_text("trainer:\n  steps: 3\n")
    r = _export(src, "--out", tmp_path / "exports" / "hf")
    assert r.returncode == 0, r.stderr


def test_an_unwritable_out_is_a_one_line_error(run, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = _export(run, "--out", blocker / "hf")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"quarl export: error: cannot write the export to {blocker / 'hf'}: ")
    assert r.stderr.rstrip().endswith("; pick a writable directory for --out")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_read_only_directory_is_a_one_line_error(run, tmp_path, monkeypatch, capsys, code):
    """As root no permission bit stops a write: the OS's refusal is simulated where the export
    first writes (its temporary directory beside --out), through the CLI's own entry point."""
    from quarl.cli.main import main

    def refuse(*args, dir=None, **kwargs):
        raise OSError(code, os.strerror(code), os.path.join(dir, ".hf.partial-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"quarl export: error: cannot write the export to {out}: {os.strerror(code)}: "
                   f"{tmp_path / '.hf.partial-x'}; pick a writable directory for --out\n")
    assert not out.exists()
