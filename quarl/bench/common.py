"""What every benchmark records beside its numbers."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any, Callable

from quarl.io import write_json_atomic


def git_commit() -> str:
    """HEAD's hash, or ``$QUARL_GIT_COMMIT`` where the checkout has no .git (device copies)."""
    if os.environ.get("QUARL_GIT_COMMIT"):
        return os.environ["QUARL_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def bench_command() -> str:
    """The command line that made this result, as a user would type it (``quarl bench ...``)."""
    return shlex.join(["quarl", *sys.argv[1:]])


def write_json(result: dict, out: str | Path | None, indent: int = 2) -> None:
    """``result`` as JSON at ``out`` (nothing for None), atomically (a temporary file renamed over
    it), with the command that made it first unless it names one already."""
    if out is None:
        return
    if "command" not in result:
        result = {"command": bench_command(), **result}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result, indent=indent)


def child_env(root: Path, commit: str | None) -> dict[str, str]:
    """The environment of a benchmark's child process that runs the ``quarl`` package in
    ``root`` (first on its path), recording ``commit`` as its code's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root.resolve()), *filter(None, [env.get("PYTHONPATH")])])
    env["QUARL_GIT_COMMIT"] = commit or f"baseline:{root}"
    return env


def package_root() -> Path:
    """The directory that holds the ``quarl`` package running now."""
    return Path(__file__).resolve().parents[2]


def check_baseline(baseline: Path) -> Path:
    """``baseline`` as a directory that holds another version's ``quarl`` package (a
    ValueError saying how to make one otherwise)."""
    if not (baseline / "quarl" / "__init__.py").is_file():
        raise ValueError(f"--baseline {baseline}: no quarl/ package there; make one from a commit with "
                         f"`git archive REV quarl | tar -x -C {baseline}`")
    return baseline


def child_failed(proc: subprocess.CompletedProcess, out: Path, root: Path, mode: str) -> RuntimeError | None:
    """The error naming a child run that exited non-zero or wrote no result, with its last lines."""
    if proc.returncode == 0 and out.is_file():
        return None
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return RuntimeError(f"the run of quarl in {root} failed on mode {mode!r} (exit {proc.returncode}):\n{tail}")


# nvidia-smi's fields for a watch over a run: clocks, temperature, power, and the active
# clock-event ("throttle") reasons, a bitmask (0x1 is the idle reason; 0x4 software power cap,
# 0x20/0x40 software/hardware thermal slowdown, 0x8 hardware slowdown)
CLOCK_FIELDS = ("index", "clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw", "clocks_event_reasons.active")
IDLE_REASON = 0x1


class ClockWatch:
    """The GPUs' SM clocks, temperatures and clock-event reasons sampled by ``nvidia-smi``
    every ``interval`` seconds while a run lasts (``with ClockWatch() as w: ...``, then
    :meth:`summary`), so that a run slowed by a GPU clocking down says so. With ``label`` (a
    function of no arguments: what the run is doing now, ``(stage, step)``) each reading is
    tagged with what it returned just before, and :meth:`by_label` says which part of a run
    the slow clocks fell in. No ``nvidia-smi`` (a CPU machine): nothing is sampled and the
    summary is None."""

    def __init__(self, interval: float = 2.0, command: str = "nvidia-smi",
                 label: Callable[[], tuple[str, int] | None] | None = None) -> None:
        import shutil
        import threading

        self.interval, self.command, self.label = interval, shutil.which(command), label
        self.fields = CLOCK_FIELDS
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ClockWatch":
        if self.command is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            tag = self.label() if self.label is not None else None
            self.samples.extend(dict(row, label=tag) for row in self.sample())
            if self._stop.wait(self.interval):
                return

    def sample(self) -> list[dict[str, float]]:
        """One reading per GPU (none where nvidia-smi fails)."""
        import subprocess

        try:
            query = [self.command, f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits"]
            done = subprocess.run(query, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return []
        if done.returncode != 0 and self.fields == CLOCK_FIELDS:  # a driver before the field's new name
            self.fields = CLOCK_FIELDS[:-1] + ("clocks_throttle_reasons.active",)
            return self.sample()
        rows = []
        for line in done.stdout.strip().splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != len(CLOCK_FIELDS):
                continue
            try:
                rows.append({"gpu": int(cells[0]), "sm_mhz": float(cells[1]), "max_sm_mhz": float(cells[2]),
                             "temp_c": float(cells[3]), "power_w": float(cells[4]), "reasons": int(cells[5], 16)})
            except ValueError:  # ("[N/A]" where a field is not supported)
                continue
        return rows

    def summary(self) -> dict[str, dict[str, float | str]] | None:
        """Per GPU: the median and lowest SM clock among the samples taken while it was busy
        (power above its idle readings' 20% mark), its maximum, the hottest reading, and the
        clock-event reasons other than idle seen at any sample (hex)."""
        if not self.samples:
            return None
        out: dict[str, dict[str, float | str]] = {}
        for gpu in sorted({s["gpu"] for s in self.samples}):
            mine = [s for s in self.samples if s["gpu"] == gpu]
            top = max(s["power_w"] for s in mine)
            busy = [s for s in mine if s["power_w"] > 0.2 * top] or mine
            clocks = sorted(s["sm_mhz"] for s in busy)
            reasons = 0
            for s in mine:
                reasons |= s["reasons"] & ~IDLE_REASON
            out[str(gpu)] = {"sm_mhz_median": clocks[len(clocks) // 2], "sm_mhz_min": clocks[0],
                             "sm_mhz_max": max(s["max_sm_mhz"] for s in mine),
                             "temp_c_max": max(s["temp_c"] for s in mine),
                             "reasons": hex(reasons), "samples": len(mine)}
        return out

    def by_label(self) -> dict[str, dict[str, Any]]:
        """Per ``stage`` the label named: the median and lowest SM clock and the median power
        over its readings (every GPU's), their count, and the median clock and power of each
        ``step`` (``{"learner": {..., "sm_mhz_by_step": {"2": 1980.0, ...}}}``); readings
        with no label are left out."""
        out: dict[str, dict[str, Any]] = {}
        tagged = [s for s in self.samples if s.get("label") is not None]
        for stage in sorted({s["label"][0] for s in tagged}):
            mine = [s for s in tagged if s["label"][0] == stage]
            steps = sorted({s["label"][1] for s in mine})
            out[stage] = {"sm_mhz_median": median(s["sm_mhz"] for s in mine),
                          "sm_mhz_min": min(s["sm_mhz"] for s in mine),
                          "power_w_median": median(s["power_w"] for s in mine), "samples": len(mine)}
            for field in ("sm_mhz", "power_w"):
                out[stage][f"{field}_by_step"] = {str(t): median(s[field] for s in mine if s["label"][1] == t)
                                                  for t in steps}
        return out


GAP_BINS_US = (5.0, 50.0)  # idle stretches: launch latency (< 5 us), short host stalls, long ones


def idle_gaps(spans: list[tuple[str, float, float]], max_gap_us: float = float("inf"),
              largest: int = 5) -> dict[str, Any]:
    """Where the GPU sat idle between kernels: ``spans`` are ``(name, start us, end us)`` in any
    order, overlaps allowed (several streams). Gaps longer than ``max_gap_us`` are left out (the
    host between graph replays). Returns the span from the first start to the last end, the
    idle time, its split by gap length (:data:`GAP_BINS_US`: ``[total us, count]`` a bin), the
    ``largest`` gaps with the kernels either side, and per kernel the idle time right before
    its launches and how many of them waited. Many sub-5-us gaps are launch latency (a graph
    removes them); long ones are the host falling behind or waiting (a sync)."""
    bins = [[0.0, 0] for _ in range(len(GAP_BINS_US) + 1)]
    out: dict[str, Any] = {"span_us": 0.0, "idle_us": 0.0, "bins": bins, "bin_edges_us": list(GAP_BINS_US),
                           "largest": [], "before": {}}
    if not spans:
        return out
    ordered = sorted(spans, key=lambda s: s[1])
    before: dict[str, tuple[float, int]] = {}
    found = []
    end, last = ordered[0][2], ordered[0][0]
    for name, start, stop in ordered[1:]:
        gap = start - end
        if 0 < gap <= max_gap_us:
            b = sum(gap >= edge for edge in GAP_BINS_US)
            bins[b][0] += gap
            bins[b][1] += 1
            t, n = before.get(name, (0.0, 0))
            before[name] = (t + gap, n + 1)
            found.append((gap, last, name))
        if stop >= end:
            end, last = stop, name
    out.update(span_us=end - ordered[0][1], idle_us=sum(b[0] for b in bins), before=before,
               largest=[[round(g, 1), a, b] for g, a, b in sorted(found, key=lambda f: -f[0])[:largest]])
    return out


def gaps_lines(gaps: dict[str, Any]) -> list[str]:
    """:func:`idle_gaps` as table lines."""
    edges = gaps["bin_edges_us"]
    names = [f"< {edges[0]:g} us"] + [f"{a:g}-{b:g} us" for a, b in zip(edges, edges[1:])] + [f">= {edges[-1]:g} us"]
    span = max(gaps["span_us"], 1e-9)
    bins = ", ".join(f"{n}: {t / 1e3:.1f} ms in {c}" for n, (t, c) in zip(names, gaps["bins"]))
    lines = [f"  GPU idle between kernels: {gaps['idle_us'] / 1e3:.1f} ms of a {span / 1e3:.1f} ms span "
             f"({gaps['idle_us'] / span:.1%}); " + bins]
    lines += [f"    gap {g / 1e3:7.2f} ms after {a} before {b}" for g, a, b in gaps["largest"]]
    return lines
