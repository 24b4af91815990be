"""`quarl export` through the CLI: refuses to overwrite, writes all or nothing, normal file modes."""

from __future__ import annotations

import os
import subprocess
import sys
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
