"""The atomic writers: the target holds the old content or the new, and no temporary file stays."""

import json
import os

import pytest

from quarl.io import atomic_path, replace_dir, write_bytes_atomic, write_json_atomic, write_text_atomic


def test_writes_replace_the_target_and_leave_nothing_beside_it(tmp_path):
    target = tmp_path / "sub" / "a.json"
    write_json_atomic(target, {"x": 1}, indent=2)
    assert json.loads(target.read_text()) == {"x": 1}
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    write_bytes_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(target.parent) == ["a.json"]
    assert (target.stat().st_mode & 0o777) == 0o666 & ~_umask()  # a plain open's mode, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary_file(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
    with pytest.raises(TypeError):
        write_json_atomic(target, {"x": object()})
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_two_writers_of_one_target_get_their_own_temporary_files(tmp_path):
    target = tmp_path / "a.txt"
    with atomic_path(target) as a, atomic_path(target) as b:
        assert a != b and a.parent == b.parent == tmp_path
        a.write_text("first")
        b.write_text("second")
    assert target.read_text() == "first"  # the last rename wins (the outer block exits last)


def test_replace_dir_swaps_a_whole_directory(tmp_path):
    dst, tmp = tmp_path / "out", tmp_path / "out.tmp"
    tmp.mkdir()
    (tmp / "f").write_text("1")
    replace_dir(tmp, dst)
    assert (dst / "f").read_text() == "1" and not tmp.exists()
    tmp.mkdir()
    (tmp / "g").write_text("2")
    replace_dir(tmp, dst)
    assert sorted(os.listdir(dst)) == ["g"] and sorted(os.listdir(tmp_path)) == ["out"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
