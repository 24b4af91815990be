"""A run's life through the real CLI: interrupts, resume, damaged files, a full disk, progress."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from quarl.trainer import checkpoint as ckpt
from tests.trainer.test_train_e2e import TINY

ROOT = Path(__file__).resolve().parents[2]
LIFE = [*TINY, "--trainer.sft_warmup_steps=0"]  # a random policy is enough here, and no warm-start is faster
STEPS = 5
VOLATILE = ("time/", "rollout/tokens_per_s", "memory/", "perf/learner_tflops", "perf/learner_mfu", "perf/compiles",
            "perf/compile_s", "perf/gc_", "perf/eval_s", "perf/setup_s", "wall")  # wall-clock


def _cli(run_dir, *args, quiet=True, wrapper=None):
    cmd = [sys.executable, "-m", "quarl"] if wrapper is None else [sys.executable, str(wrapper)]
    cmd += ["train", *(["--quiet"] if quiet else []), f"--trainer.run_dir={run_dir}", *args]
    # a wrapper script's own directory comes first on sys.path: point it at this checkout's quarl
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir):
    return ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["learner"]["model"]


def _assert_same_run(a, b):
    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb):
        kx = {k: v for k, v in x.items() if not k.startswith(VOLATILE)}
        ky = {k: v for k, v in y.items() if not k.startswith(VOLATILE)}
        assert kx == ky, x["step"]
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _start_and_signal(run_dir, sig, *args, after_lines=2, twice=False):
    """Start a run, send ``sig`` right after metrics line ``after_lines`` appears (mid-step)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "quarl", "train", "--quiet", *LIFE, f"--trainer.run_dir={run_dir}",
         f"--trainer.steps={STEPS}", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= after_lines:
            break
        time.sleep(0.02)
    if twice:
        time.sleep(0.2)  # past the checkpoint of the step just logged, into the next step
    proc.send_signal(sig)
    head = ""
    if twice:
        # signals that arrive before Python runs the handler merge into one: wait until it has run
        while "interrupt (" not in head and (line := proc.stderr.readline()):
            head += line
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    err = head + err
    return proc.returncode, err


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: STEPS steps without a stop."""
    run_dir = tmp_path_factory.mktemp("straight")
    r = _cli(run_dir, *LIFE, f"--trainer.steps={STEPS}")
    assert r.returncode == 0, r.stderr
    return run_dir


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_signal_then_resume_is_exact(tmp_path, straight, sig):
    code, err = _start_and_signal(tmp_path, sig)
    assert code == 130, err
    assert "finishing step" in err and "Traceback" not in err
    done = len(_rows(tmp_path))
    assert 2 <= done < STEPS
    # the step in flight (the one after the 2nd line) was finished, logged and saved; the signal
    # almost always lands mid-step, rarely between the log line and the next step
    assert f"finishing step {done}," in err or (done == 2 and "interrupt (SIG" in err and ": saving" in err), err
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == done
    assert (tmp_path / "report.html").is_file()  # written after an interrupt too
    r = _cli(tmp_path, "--resume")  # no flags: the run's own config.yaml
    assert r.returncode == 0, r.stderr
    _assert_same_run(straight, tmp_path)


def test_sigkill_then_resume_is_exact_despite_torn_line(tmp_path, straight):
    code, _ = _start_and_signal(tmp_path, signal.SIGKILL, "--trainer.save_every=1")
    assert code == -signal.SIGKILL
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what a kill in the middle of a write leaves
        f.write('{"step": 99, "reward/me')
    r = _cli(tmp_path, "--resume")
    assert r.returncode == 0, r.stderr
    assert "metrics.jsonl" in r.stderr and "cut short" in r.stderr
    _assert_same_run(straight, tmp_path)


def test_second_ctrl_c_stops_at_once_and_keeps_last_checkpoint(tmp_path):
    # longer steps (~1 s), so that both signals land inside the same step
    code, err = _start_and_signal(tmp_path, signal.SIGINT, "--trainer.save_every=1", "--trainer.prompts_per_step=16",
                                  "--rollout.max_new_tokens=48", twice=True)
    assert code == 130, err
    assert "stopped" in err and "Traceback" not in err
    left = [p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()]
    assert not [n for n in left if ".tmp-" in n], left  # no half-written checkpoint stays behind
    latest = ckpt.latest_checkpoint(tmp_path)
    assert ckpt.load_checkpoint(latest)["step"] >= 2
    r = _cli(tmp_path, "--resume", "--trainer.steps=4")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3, 4]


def test_resume_checks_config_first_and_names_changes(tmp_path):
    r = _cli(tmp_path, *LIFE, "--trainer.steps=2")
    assert r.returncode == 0, r.stderr
    saved = (tmp_path / "config.yaml").read_text()

    r = _cli(tmp_path, "--resume", "--rollout.n=2", "--trainer.seed=5")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "rollout.n: 4 -> 2" in r.stderr and "trainer.seed: 0 -> 5" in r.stderr
    assert "--allow-config-change" in r.stderr
    assert (tmp_path / "config.yaml").read_text() == saved

    # accepted, but the checkpoint cannot fit another model: a clear error, config.yaml untouched
    r = _cli(tmp_path, "--resume", "--allow-config-change", "--model.builtin=small")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "step_000002" in r.stderr and "does not fit" in r.stderr
    assert (tmp_path / "config.yaml").read_text() == saved

    r = _cli(tmp_path, "--resume", "--trainer.steps=3")
    assert r.returncode == 0, r.stderr
    assert "trainer.steps changed 2 -> 3" in r.stderr
    assert "train step" not in r.stderr  # --quiet: no progress
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3]
    assert "steps: 3" in (tmp_path / "config.yaml").read_text()


def test_metrics_without_checkpoint_is_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    r = _cli(tmp_path, *LIFE, "--trainer.steps=1")
    assert r.returncode == 2, r.stderr
    assert "already holds a run" in r.stderr and "from step 0" in r.stderr and "--resume" in r.stderr
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 0.5  # nothing wiped

    r = _cli(tmp_path, *LIFE, "--trainer.steps=1", "--resume")
    assert r.returncode == 0, r.stderr
    assert "starting from step 0" in r.stderr
    rows = _rows(tmp_path)
    assert [row["step"] for row in rows] == [1] and rows[0]["reward/mean"] != 0.5


def test_corrupt_latest_checkpoint_falls_back(tmp_path):
    r = _cli(tmp_path, *LIFE, "--trainer.steps=4", "--trainer.save_every=2")
    assert r.returncode == 0, r.stderr
    state = ckpt.checkpoint_dir(tmp_path) / "step_000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])

    r = _cli(tmp_path, "--resume", "--trainer.steps=5")
    assert r.returncode == 0, r.stderr
    assert "step_000004" in r.stderr and "step_000002" in r.stderr
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3, 4, 5]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 5
    assert list(ckpt.checkpoint_dir(tmp_path).glob("step_000004.corrupt-*"))  # moved aside, not deleted

    for d in ckpt.list_checkpoints(tmp_path):
        (d / "meta.json").write_text("{not json")
    r = _cli(tmp_path, "--resume", "--trainer.steps=6")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no checkpoint" in r.stderr and "can be loaded" in r.stderr


def _wrapper(tmp_path, prelude: str):
    """A `python -m quarl` that first runs ``prelude`` (to simulate a failing system)."""
    path = tmp_path / "quarl_wrapped.py"
    path.write_text(textwrap.dedent(prelude) + "\nimport sys\nfrom quarl.cli.main import main\nsys.exit(main())\n")
    return path


def test_disk_full_while_saving(tmp_path):
    wrapper = _wrapper(tmp_path, """
        import errno, torch
        real_save, calls = torch.save, []
        def full_disk(obj, f, *a, **k):
            calls.append(f)
            if len(calls) == 1:
                return real_save(obj, f, *a, **k)
            open(f, "wb").write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.save = full_disk
    """)
    run_dir = tmp_path / "run"
    r = _cli(run_dir, *LIFE, "--trainer.steps=3", "--trainer.save_every=1", wrapper=wrapper)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    msg = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(msg) == 1 and "step_000002" in msg[0] and "No space left" in msg[0]
    assert "step 1" in msg[0] and "--resume" in msg[0]
    assert [p.name for p in ckpt.checkpoint_dir(run_dir).iterdir()] == ["step_000001"]  # temp dir removed
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["step"] == 1

    r = _cli(run_dir, "--resume")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in _rows(run_dir)] == [1, 2, 3]


def test_progress_off_a_terminal_and_report_failure_is_a_warning(tmp_path):
    wrapper = _wrapper(tmp_path, "import sys\nsys.modules['matplotlib'] = None  # as if not installed\n")
    run_dir = tmp_path / "run"
    r = _cli(run_dir, *TINY, "--trainer.steps=3", "--trainer.sft_warmup_steps=10", quiet=False, wrapper=wrapper)
    assert r.returncode == 0, r.stderr
    for line in ("warm-start step 1/10", "warm-start step 10/10", "train step 1/3", "train step 3/3"):
        assert line in r.stderr, line
    train_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("train step")]
    assert all("reward" in ln and "kl3" in ln and "s/step" in ln and "eta" in ln for ln in train_lines)
    assert "could not write" in r.stderr and "report.html" in r.stderr
    assert not (run_dir / "report.html").exists() and "finished 3 steps" in r.stdout
