"""What every benchmark result records beside its numbers: the command that made it."""

from __future__ import annotations

import json
import sys

from quarl.bench.common import bench_command, write_json


def test_a_result_names_the_command_that_made_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/quarl/__main__.py", "bench", "rollout", "--formats", "w4a16,bf16",
                                      "--note", "two words"])
    assert bench_command() == "quarl bench rollout --formats w4a16,bf16 --note 'two words'"
    out = tmp_path / "sub" / "r.json"
    write_json({"rows": [1]}, out)
    saved = json.loads(out.read_text())
    assert list(saved) == ["command", "rows"]
    assert saved["command"] == bench_command()
    # a result that names its command keeps it; None writes nothing
    write_json({"command": "quarl bench gemm", "rows": []}, out)
    assert json.loads(out.read_text())["command"] == "quarl bench gemm"
    write_json({"rows": []}, None)
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.json"]
