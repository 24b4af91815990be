"""The error-token detector's hits, kept with a suite's results and shown on its page.

A run's trainer logs up to two flagged training responses a step to ``samples.jsonl``
(:mod:`quarl.trainer.error_tokens`: ``flagged``, ``error_kind`` loop / garbled,
``error_pos``, ``response_tokens`` and ``error_text``, the completion cut as [before, the
bad token, after]). :func:`copy_flagged` keeps some of them beside the run's metrics in the
results directory (``flagged.jsonl``: the earliest and the latest, so that both the start
and the end of training show); :func:`flagged_section` renders a few of each run's as
examples under the results page's plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLAGGED_FILE = "flagged.jsonl"
KEPT_PER_RUN = 20  # flagged responses a run keeps in the results directory (half earliest, half latest)
SHOWN_PER_RUN = 2  # examples a run shows on the page
CONTEXT_CHARS = 80  # characters shown on each side of the bad token


def read_flagged(samples_file: Path) -> list[dict[str, Any]]:
    """The flagged training responses of a run's ``samples.jsonl``, in the order logged
    (none where the file is missing; a last line cut by a crash is skipped)."""
    if not samples_file.is_file():
        return []
    rows = []
    for line in samples_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("flagged") and isinstance(row.get("error_text"), list):
            rows.append(row)
    return rows


def copy_flagged(samples_file: Path, dst: Path, kept: int = KEPT_PER_RUN) -> int:
    """Write up to ``kept`` of ``samples_file``'s flagged responses to ``dst`` (the earliest
    half and the latest half; ``dst`` is removed where there are none); returns how many the
    run logged in all."""
    rows = read_flagged(samples_file)
    if not rows:
        dst.unlink(missing_ok=True)
        return 0
    chosen = rows if len(rows) <= kept else rows[: kept // 2] + rows[len(rows) - (kept - kept // 2):]
    dst.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return len(rows)


def _snippet(row: dict[str, Any]) -> str:
    before, bad, after = (list(row["error_text"]) + ["", "", ""])[:3]
    left = ("..." if len(before) > CONTEXT_CHARS else "") + before[-CONTEXT_CHARS:]
    right = after[:CONTEXT_CHARS] + ("..." if len(after) > CONTEXT_CHARS else "")
    return (left + "[[" + bad + "]]" + right).replace("~~~", "~ ~ ~")


def flagged_section(out: Path, names: list[str], seeds: list[int], shown: int = SHOWN_PER_RUN) -> list[str]:
    """The page's lines on the flagged responses kept under ``out/runs`` (none when no run has
    any): per run, how many were kept and ``shown`` examples, each with its step, kind, place
    and reward, the bad token in [[ ]] between its context."""
    lines: list[str] = []
    for name in names:
        rows = []
        for seed in seeds:
            f = out / "runs" / name / f"seed{seed}" / FLAGGED_FILE
            if f.is_file():
                rows += [dict(json.loads(line), seed=seed) for line in f.read_text().splitlines() if line.strip()]
        if not rows:
            continue
        kinds = {k: sum(r.get("error_kind") == k for r in rows) for k in ("loop", "garbled")}
        lines += [f"**{name}**: {len(rows)} kept ({kinds['loop']} loops, {kinds['garbled']} garbled); for example:",
                  ""]
        for r in _spread(rows, shown):
            lines += [f"- seed {r['seed']}, step {r.get('step')}: {r.get('error_kind')} from response token "
                      f"{r.get('error_pos')} of {r.get('response_tokens')}, reward {r.get('reward')}", "",
                      "~~~", _snippet(r), "~~~", ""]
    if not lines:
        return []
    return ["## Error-token examples", "",
            "Training responses the error-token detector flagged (`quarl.algos.errors`; the trainer logs up to "
            f"two a step, the results keep the earliest and latest {KEPT_PER_RUN} of each run in "
            f"`runs/<run>/seed<k>/{FLAGGED_FILE}`). The first bad token is in [[ ]].", "", *lines]


def _spread(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` of ``rows`` spread over them (the first and the last for two)."""
    if len(rows) <= n:
        return rows
    if n == 1:
        return rows[:1]
    return [rows[round(i * (len(rows) - 1) / (n - 1))] for i in range(n)]
