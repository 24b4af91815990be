"""A suite's error-token examples: the flagged responses a run logged, kept with its results
and shown on the page."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from quarl.experiments.flagged import FLAGGED_FILE, KEPT_PER_RUN, copy_flagged, flagged_section, read_flagged
from quarl.experiments.results import render
from quarl.experiments.suite import collect, load_suite


def _flagged(step: int, kind: str = "loop", before: str = "1:3+4=7;", bad: str = "7", after: str = "777") -> dict:
    return {"step": step, "prompt": "3(+4-1+2-1)x1=", "completion": before + bad + after, "answer": "7",
            "reward": 0.0, "flagged": True, "error_kind": kind, "error_pos": len(before),
            "response_tokens": len(before + bad + after), "error_text": [before, bad, after]}


def _samples(path: Path, rows: list[dict], cut_last: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + ('{"step": 99, "flag' if cut_last else ""))
    return path


def test_copy_keeps_the_earliest_and_latest_flagged_responses(tmp_path):
    evaluation = {"step": 0, "prompt": "p", "completion": "c", "answer": "1", "reward": 0.0, "error_kind": "loop",
                  "error_pos": 3}  # a greedy evaluation's loop: not a flagged training response
    rows = [_flagged(s, "garbled" if s % 3 == 0 else "loop") for s in range(1, 31)]
    src = _samples(tmp_path / "run" / "samples.jsonl", [evaluation, *rows], cut_last=True)
    assert [r["step"] for r in read_flagged(src)] == list(range(1, 31))
    dst = tmp_path / "out" / FLAGGED_FILE
    dst.parent.mkdir()
    assert copy_flagged(src, dst) == 30
    kept = [json.loads(line) for line in dst.read_text().splitlines()]
    half = KEPT_PER_RUN // 2
    assert [r["step"] for r in kept] == list(range(1, half + 1)) + list(range(31 - half, 31))
    assert kept[0] == rows[0]  # whole rows
    assert copy_flagged(src, dst, kept=3) == 30
    assert [json.loads(line)["step"] for line in dst.read_text().splitlines()] == [1, 29, 30]
    # a run with none (or no samples.jsonl) leaves no file behind
    assert copy_flagged(_samples(tmp_path / "quiet" / "samples.jsonl", [evaluation]), dst) == 0
    assert not dst.exists()
    assert copy_flagged(tmp_path / "nowhere" / "samples.jsonl", dst) == 0 and not dst.exists()


def test_the_section_shows_each_runs_examples_with_the_bad_token_marked(tmp_path):
    long_before = "x" * 200 + "9+9=18;"
    for seed, rows in ((0, [_flagged(5), _flagged(9, "garbled", long_before, "@", "#18")]), (1, [_flagged(40)])):
        d = tmp_path / "runs" / "rollout" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / FLAGGED_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = flagged_section(tmp_path, ["bf16", "rollout"], [0, 1])
    text = "\n".join(lines)
    assert lines[0] == "## Error-token examples"
    assert "**bf16**" not in text  # a run with none is not listed
    assert "**rollout**: 3 kept (2 loops, 1 garbled); for example:" in text
    # two examples spread over the three: the first and the last
    assert "- seed 0, step 5: loop from response token 8 of 12, reward 0.0" in text
    assert "- seed 1, step 40: loop from response token 8 of 12" in text and "step 9" not in text
    assert "1:3+4=7;[[7]]777" in text
    one = "\n".join(flagged_section(tmp_path, ["rollout"], [0], shown=2))
    assert "\n..." + "x" * 73 + "9+9=18;[[@]]#18\n" in one  # 80 characters of context before the bad token
    assert flagged_section(tmp_path, ["bf16"], [0, 1]) == []


def test_collect_keeps_flagged_responses_and_the_page_shows_them(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    (root / "suite.yaml").write_text(yaml.safe_dump({"seeds": [0], "table": ["acc"]}))
    for name in ("bf16", "w4"):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({"quant": {"mode": "bf16"}}))
    suite = load_suite(root)
    work, out = tmp_path / "work", tmp_path / "out"
    for name in ("bf16", "w4"):
        d = work / "runs" / name / "seed0"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "acc": 0.5}) + "\n")
    _samples(work / "runs" / "w4" / "seed0" / "samples.jsonl", [_flagged(1, "garbled", "1:3", "?", "")])
    collect(suite, work, out)
    assert not (out / "runs" / "bf16" / "seed0" / FLAGGED_FILE).exists()
    assert json.loads((out / "runs" / "w4" / "seed0" / FLAGGED_FILE).read_text())["error_kind"] == "garbled"
    page = render(out).read_text()
    assert "## Error-token examples" in page and "**w4**: 1 kept (0 loops, 1 garbled)" in page
    assert "1:3[[?]]" in page
