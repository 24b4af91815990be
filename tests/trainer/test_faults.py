"""Faults through the real CLI: a hung or flaky verifier, a failed evaluation, two processes in one
run directory, read-only directories, checkpoint write failures, Ctrl-C, resume settings, hints."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from quarl.cli.main import main
from quarl.trainer import checkpoint as ckpt
from tests.trainer.test_run_lifecycle import LIFE, ROOT, _cli, _rows, _wrapper

FNS = "tests.trainer.reward_fns"


def _error_line(r) -> str:
    """The one line a failed command printed (no traceback)."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("quarl train: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def _main_error(capsys, run_dir, *args) -> str:
    """``quarl train`` in this process, expected to fail with one line (exit 2): the line."""
    code = main(["train", "--quiet", f"--trainer.run_dir={run_dir}", *args])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("quarl train: error: "), err
    return lines[0]


def _start(run_dir, *args, wrapper=None):
    cmd = [sys.executable, "-m", "quarl"] if wrapper is None else [sys.executable, str(wrapper)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([*cmd, "train", "--quiet", *LIFE, f"--trainer.run_dir={run_dir}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_rows(proc, run_dir, rows: int) -> None:
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {rows} metrics rows: {proc.poll()} {proc.stderr.read() if proc.poll() else ''}")


# ----------------------------------------------------------------------------- the verifier


def test_a_verifier_that_hangs_on_every_item_stops_the_run_after_about_two_timeouts(tmp_path):
    run_dir = tmp_path / "runs" / "hung"
    start = time.monotonic()
    r = _cli(run_dir, *LIFE, "--trainer.steps=3", f"--data.reward={FNS}:always_hangs", "--data.reward_workers=2",
             "--data.reward_timeout_s=3", "--trainer.prompts_per_step=8")
    elapsed = time.monotonic() - start
    assert r.returncode == 2
    line = _error_line(r)
    assert f"reward {FNS}:always_hangs timed out on all 32 items" in line and "were not tried" in line
    assert "raise data.reward_timeout_s (now 3)" in line and "no step was trained" in line
    assert elapsed < 32 * 3 / 2, elapsed  # each item timing out in turn on 2 workers would take 48 s
    assert not (tmp_path / "runs").exists()  # a run that failed before its first step leaves no directory


def test_sigterm_while_the_verifier_hangs_saves_the_last_step_and_exits(tmp_path, monkeypatch):
    marker = tmp_path / "hang"
    monkeypatch.setenv("QUARL_TEST_HANG_MARKER", str(marker))
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--trainer.steps=50", f"--data.reward={FNS}:hangs_once_marked", "--data.reward_workers=2",
                  "--data.reward_timeout_s=120")
    _wait_rows(proc, run_dir, 2)
    marker.touch()  # the next step's verifier hangs (for 120 s a item, were it left to time out)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "abandoned: its verifier was still busy" in err
    assert "no checkpoint has been written yet" in err and "stays intact" not in err  # (save_every=0)
    done = len(_rows(run_dir))
    assert done >= 2 and ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["step"] == done
    assert f"interrupted after step {done} (checkpoint saved)" in err
    marker.unlink()
    r = _cli(run_dir, "--resume", f"--trainer.steps={done + 1}", "--data.reward_workers=0")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in _rows(run_dir)] == list(range(1, done + 2))


def test_a_flaky_verifier_trains_and_the_final_evaluation_scores_it_in_the_pool(tmp_path):
    r = _cli(tmp_path, *LIFE, "--trainer.steps=2", "--trainer.eval_every=2", f"--data.reward={FNS}:flaky",
             "--data.reward_workers=2")
    assert r.returncode == 0, r.stderr
    rows = _rows(tmp_path)
    assert all(row["reward/errors"] > 0 for row in rows)  # counted, scored 0, trained on
    assert "eval/acc" in rows[-1] and rows[-1]["eval/reward_errors"] > 0  # the evaluation's errors, in the pool
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 2
    assert (tmp_path / "report.html").is_file()


def test_a_failed_evaluation_keeps_the_trained_steps(tmp_path):
    r = _cli(tmp_path, *LIFE, "--trainer.steps=2", "--trainer.eval_every=2",
             f"--data.reward={FNS}:raises_after_32_calls")
    assert r.returncode == 1
    line = _error_line(r)
    assert "the evaluation after step 2 failed (RewardFailed: reward" in line and "KeyError: 'gold_answer'" in line
    assert "step_000002" in line and f"quarl eval {tmp_path}" in line
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2]  # the step's row is logged, without eval/
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 2
    assert (tmp_path / "report.html").is_file()


# ----------------------------------------------------------------------------- Ctrl-C


GC_CALLBACK_SIGNAL = """
    import gc, os, signal, time
    from quarl.trainer import interrupt, loop
    first, sent = [], []
    real_handle = interrupt.GracefulStop._handle
    def handle(self, signum, frame):
        real_handle(self, signum, frame)
        first.append(signum)
    interrupt.GracefulStop._handle = handle
    def callback(phase, info):  # the second Ctrl-C lands inside a garbage-collector callback
        if first and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10):  # (the handler runs here, where Python can only print an exception)
                pass
    gc.callbacks.append(callback)
    def collecting(method):  # the next of these after the first Ctrl-C collects, then waits for the stop
        def call(self, *args):
            if first and not sent:
                gc.collect()
                time.sleep(5)  # (a signal's handler runs during the sleep; a lost one lets it pass)
            return method(self, *args)
        return call
    for name in ("update_policy", "_log", "save"):
        setattr(loop.Trainer, name, collecting(getattr(loop.Trainer, name)))
"""


def test_a_second_ctrl_c_inside_a_gc_callback_stops_without_a_traceback_or_a_false_claim(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "--trainer.steps=200", wrapper=_wrapper(tmp_path, GC_CALLBACK_SIGNAL))
    _wait_rows(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Exception ignored" not in err and "Traceback" not in err
    assert "no checkpoint has been written yet, so nothing of this run would be kept" in err  # (save_every=0)
    assert "stopped; no checkpoint was written, so its" in err and "steps are lost" in err
    assert "intact" not in err and ckpt.latest_checkpoint(run_dir) is None


# ----------------------------------------------------------------------------- resume settings


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    assert main(["train", "--quiet", *LIFE, f"--trainer.run_dir={run_dir}", "--trainer.steps=2"]) == 0
    return run_dir


def _resumed(base, tmp_path, capsys, *flags):
    """Two more steps of a copy of ``base`` with ``flags``: stderr, their rows, the optimizer's state."""
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", f"--trainer.run_dir={run_dir}", "--trainer.steps=4", *flags]) == 0
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["learner"]["optimizer"]
    return capsys.readouterr().err, _rows(run_dir)[2:], state


def test_resume_applies_a_changed_learning_rate_weight_decay_and_betas(two_steps, tmp_path, capsys):
    assert [row["train/lr"] for row in _rows(two_steps)] == [1e-3, 1e-3]
    err, rows, optimizer = _resumed(two_steps, tmp_path, capsys, "--optim.lr=0.5", "--optim.weight_decay=0.1",
                                    "--optim.betas=[0.8,0.9]")
    assert [row["train/lr"] for row in rows] == [0.5, 0.5]
    for key in ("optim.lr changed 0.001 -> 0.5", "optim.weight_decay changed 0.0 -> 0.1", "optim.betas changed"):
        assert f"resume: {key}" in err
    assert err.count("(applied from the first resumed step)") == 3
    group = optimizer["param_groups"][0]
    assert group["lr"] == 0.5 and group["weight_decay"] == 0.1 and tuple(group["betas"]) == (0.8, 0.9)


def test_resume_applies_a_changed_warmup(two_steps, tmp_path, capsys):
    _, rows, _ = _resumed(two_steps, tmp_path, capsys, "--optim.warmup_steps=10")
    # the factor of the optimizer steps taken so far (one a step here): (k + 1) / 10 after step k
    assert [row["train/lr"] for row in rows] == pytest.approx([1e-3 * 4 / 10, 1e-3 * 5 / 10])


def test_resume_applies_a_changed_muon_rate(tmp_path, capsys):
    base = tmp_path / "muon"
    assert main(["train", "--quiet", *LIFE, f"--trainer.run_dir={base}", "--trainer.steps=2", "--optim.name=muon"]) == 0
    assert [row["train/lr"] for row in _rows(base)] == [1e-3, 1e-3]  # (the first group: Muon's matrices)
    _, rows, _ = _resumed(base, tmp_path, capsys, "--optim.muon_lr=0.02")
    assert [row["train/lr"] for row in rows] == [0.02, 0.02]


# ----------------------------------------------------------------------------- the run directory


def test_a_second_process_in_a_run_directory_fails_at_once_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = _start(run_dir, "--trainer.steps=500", "--trainer.save_every=1")
    try:
        _wait_rows(first, run_dir, 1)
        for extra in ((), ("--resume",)):
            # at once, before anything is built: a model path that does not exist is not even looked at
            r = _cli(run_dir, *LIFE, "--trainer.steps=3", "--model.path=/nonexistent", *extra)
            assert r.returncode == 2
            line = _error_line(r)
            assert f"is in use by another quarl process (pid {first.pid})" in line and "--trainer.run_dir" in line
    finally:
        first.kill()  # SIGKILL: the lock file stays behind, naming a dead process
        first.communicate()
    assert (run_dir / ".quarl.lock").read_text().split()[0] == str(first.pid)
    done = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))["step"]
    r = _cli(run_dir, "--resume", f"--trainer.steps={done + 1}")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in _rows(run_dir)] == list(range(1, done + 2))  # each step once, in order


@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` made read-only for real: a read-only bind mount as root (chmod binds no root), else
    chmod."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if not _bind_mounted(path):
        # a container that may not mount: the kernel's answer for a read-only file system, given by os.open
        with _erofs_below(path):
            yield
        return
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path), str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _bind_mounted(path: Path) -> bool:
    try:
        return subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode == 0
    except OSError:  # (no mount command)
        return False


@contextlib.contextmanager
def _erofs_below(path: Path):
    """``os.open`` and ``os.mkdir`` of anything below ``path`` for writing fail with EROFS."""
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def below(p) -> bool:
        return Path(p).absolute().is_relative_to(path.absolute())

    def fake_open(p, flags, *a, **k):
        if flags & writes and below(p):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
        return real_open(p, flags, *a, **k)

    def fake_mkdir(p, *a, **k):
        if below(p):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
        return real_mkdir(p, *a, **k)

    with mock.patch("os.open", fake_open), mock.patch("os.mkdir", fake_mkdir):
        yield


def test_a_read_only_run_directory_is_one_line_for_train_and_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--quiet", *LIFE, f"--trainer.run_dir={run_dir}", "--trainer.steps=1"]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    capsys.readouterr()
    with _read_only(empty), _read_only(run_dir):
        for target in (empty, empty / "new"):
            line = _main_error(capsys, target, *LIFE, "--trainer.steps=1")
            assert f"cannot write to the run directory {target}: " in line and "--trainer.run_dir=DIR" in line
        line = _main_error(capsys, run_dir, "--resume", "--trainer.steps=2")
        assert f"cannot write to the run directory {run_dir}: " in line
        assert "copy the run to a writable disk and resume it there" in line
    assert [row["step"] for row in _rows(run_dir)] == [1]  # nothing lost
    (tmp_path / "file").write_text("")
    line = _main_error(capsys, tmp_path / "file" / "run", *LIFE, "--trainer.steps=1")  # a path through a file
    assert "Not a directory" in line


def test_a_checkpoint_write_failure_from_torch_save_is_one_line(tmp_path, monkeypatch, capsys):
    real, calls = torch.save, []

    def full_disk(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 1:
            return real(obj, f, *a, **k)
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    code = main(["train", "--quiet", *LIFE, f"--trainer.run_dir={tmp_path}", "--trainer.steps=3",
                 "--trainer.save_every=1"])
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "Traceback" not in err
    assert "could not write checkpoint" in lines[0] and "step_000002" in lines[0]
    assert "PytorchStreamWriter failed writing file" in lines[0]
    assert "the checkpoint of step 1" in lines[0] and "is intact" in lines[0]
    assert f"quarl train --resume --trainer.run_dir={tmp_path}" in lines[0]
    assert [p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()] == ["step_000001"]
    monkeypatch.undo()
    assert main(["train", "--quiet", "--resume", f"--trainer.run_dir={tmp_path}"]) == 0
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3]


# ----------------------------------------------------------------------------- smaller faults


def test_resume_of_a_mistyped_or_empty_directory_fails(tmp_path, capsys):
    line = _main_error(capsys, tmp_path / "typo", "--resume", *LIFE)
    assert f"--resume: {tmp_path / 'typo'} does not exist" in line and "drop --resume" in line
    assert not (tmp_path / "typo").exists()
    line = _main_error(capsys, tmp_path, "--resume", *LIFE)
    assert f"--resume: {tmp_path} holds no run" in line
    assert list(tmp_path.iterdir()) == []


def test_a_token_budget_below_one_row_warns_once_naming_a_larger_one(tmp_path, capsys):
    assert main(["train", "--quiet", *LIFE, f"--trainer.run_dir={tmp_path}", "--trainer.steps=2",
                 "--trainer.token_budget=1"]) == 0
    err = capsys.readouterr().err
    assert err.count("trainer.token_budget=1 is smaller than one row") == 1
    assert "--trainer.token_budget=256 would hold two rows" in err


def test_hints_name_the_flags_of_the_command_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _main_error(capsys, tmp_path / "run", *LIFE, "--trainer.device=cuda")
    assert "use --trainer.device=cpu" in line and " --device" not in line
    assert not (tmp_path / "run").exists()  # (the directory its lock made is gone with the failed run)
