"""`quarl report` on synthetic runs: files, overlays, missing data, escaping, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quarl.cli.main import main
from quarl.trainer.report import PANELS, render_report

ALL_METRICS = [m for p in PANELS for m in p.metrics if m != "eval/acc"] + [
    "time/rollout", "time/learner", "time/publish", "time/step", "rollout/tokens_per_s"]


def _write_run(run_dir: Path, steps: int, metrics: list[str], offset: float = 0.0, config: str | None = None,
               samples: list[dict] | None = None) -> Path:
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            row = {"step": s, **{m: 0.1 + offset + 0.01 * s + 0.001 * i for i, m in enumerate(metrics)}}
            if s == 2:
                row[metrics[0]] = None  # the logger writes non-finite values as null
            if s % 5 == 0:
                row["eval/acc"] = 0.5 + offset
            f.write(json.dumps(row) + "\n")
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    if samples is not None:
        (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run_dir


def _pngs(html_path: Path) -> list[Path]:
    return sorted((html_path.parent / f"{html_path.stem}_files").glob("*.png"))


def test_single_run_report(tmp_path):
    samples = [{"step": 10, "prompt": "2+2 <b>?", "completion": "<script>alert(1)</script> 4", "answer": "4",
                "reward": 1.0}]
    run = _write_run(tmp_path / "aligned-w4", 12, ALL_METRICS, samples=samples,
                     config="quant:\n  mode: aligned\n  scheme: w4a16\n  uaq_scale: 1.5\nalgo:\n  loss: tbpo\n")
    out = render_report([run])
    assert out == run / "report.html"
    page = out.read_text()
    assert len(_pngs(out)) == len(PANELS) + 1  # + the step-time figure
    assert page.count('src="data:image/png;base64,') == len(PANELS) + 1
    assert "aligned-w4" in page and "w4a16" in page and "tbpo" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; 4" in page and "<script>" not in page
    assert "2+2 &lt;b&gt;?" in page
    # final reward: the last reward/mean (0.1 + 0.12), final eval acc 0.5 at step 10
    assert "0.22" in page and "0.5" in page


def test_flagged_responses_get_their_own_section_with_the_bad_token_marked(tmp_path):
    evaluated = {"step": 4, "prompt": "1+1=", "completion": "2", "answer": "2", "reward": 1.0,
                 "error_kind": None, "error_pos": None}
    looping = {"step": 5, "prompt": "3+3=", "completion": "6 6 6", "answer": "6", "reward": 0.0,
               "error_kind": "loop", "error_pos": 7}
    flagged = [{"step": s, "prompt": "2+2=", "completion": "4 <b>x</b>zz", "answer": "4", "reward": 0.0,
                "flagged": True, "error_kind": "garbled", "error_pos": 2, "response_tokens": 5,
                "error_text": ["4 ", "<b>", "x</b>zz"]} for s in range(1, 7)]
    run = _write_run(tmp_path / "r", 6, ["reward/mean", "errors/response_frac", "errors/first_pos"],
                     samples=[evaluated, *flagged[:3], looping, *flagged[3:]])
    page = render_report([run]).read_text()
    assert "Error tokens" in page  # the errors panel
    assert "Flagged responses (error tokens)" in page
    # the last 4 flagged (steps 3-6), each with its bad token in <mark> and escaped
    assert page.count("4 <mark>&lt;b&gt;</mark>x&lt;/b&gt;zz") == 4
    assert "step 3 · garbled from response token 2 of 5" in page and "step 2 · garbled" not in page
    # the last samples are the evaluated ones, with an eval loop's place named
    last = page[page.index("Last samples"):page.index("Flagged responses")]
    assert "1+1=" in last and "step 5 · reward 0.0 · answer 6 · loop from response token 7" in last
    assert "2+2=" not in last
    plain = _write_run(tmp_path / "p", 3, ["reward/mean"], samples=[evaluated])
    assert "Flagged responses" not in render_report([plain]).read_text()  # no section without flagged rows


def test_two_runs_overlaid_one_with_missing_metrics(tmp_path):
    full = _write_run(tmp_path / "runs" / "full", 30, ALL_METRICS)
    sparse = _write_run(tmp_path / "runs" / "sparse", 8, ["reward/mean", "entropy"], offset=0.3)  # no config/samples
    out = render_report([full, sparse])
    assert out == full / "report-compare.html"
    page = out.read_text()
    assert "full" in page and "sparse" in page and "no samples.jsonl" in page
    assert len(_pngs(out)) == len(PANELS) + 1


def test_runs_with_little_data(tmp_path):
    only_reward = _write_run(tmp_path / "a", 5, ["reward/mean"])
    out = render_report([only_reward], out_dir=tmp_path / "out")
    assert out == tmp_path / "out" / "report.html"
    assert [p.name for p in _pngs(out)] == ["reward.png"]
    assert "No data in any run for:" in out.read_text()
    # every value null except one step; a metric that is null everywhere gets no subplot
    run = tmp_path / "nulls"
    run.mkdir()
    rows = [{"step": 1, "reward/mean": None, "entropy": None}, {"step": 2, "reward/mean": math.inf}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r).replace("Infinity", "null") + "\n" for r in rows))
    out = render_report([run])
    assert _pngs(out) == []


def test_same_named_runs_get_distinct_labels(tmp_path):
    a = _write_run(tmp_path / "exp1" / "run", 3, ["reward/mean"])
    b = _write_run(tmp_path / "exp2" / "run", 3, ["reward/mean"])
    page = render_report([a, b]).read_text()
    assert "exp1/run" in page and "exp2/run" in page


def test_missing_metrics_file_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        render_report([tmp_path])
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_cli_prints_the_path(tmp_path, capsys):
    run = _write_run(tmp_path / "r", 3, ["reward/mean"])
    assert main(["report", str(run), "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o" / "report.html")


def test_report_skips_a_torn_last_line_and_names_a_bad_middle_one(tmp_path, capsys):
    run = _write_run(tmp_path / "run", 6, ALL_METRICS)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "reward/me')  # a crash mid-write
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "cut short" in err
    assert (run / "report.html").is_file()

    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = "{oops"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl, line 3" in err and "Traceback" not in err
