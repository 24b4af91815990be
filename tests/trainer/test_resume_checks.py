"""The pieces behind --resume and progress, without a model: config changes, run detection, JSONL, progress."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from quarl.config import RunConfig
from quarl.config.typed import to_dict
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.logger import read_jsonl, truncate_after
from quarl.trainer.progress import StepProgress
from quarl.trainer.resume import check_config_change, config_changes, existing_run


def _cfg(**changes) -> dict:
    d = to_dict(RunConfig())
    for key, value in changes.items():
        section, name = key.split("__")
        d[section][name] = value
    return d


def test_unchanged_config_gives_no_notice():
    assert check_config_change(_cfg(), _cfg(), "x", allow=False) == []


def test_fixed_changes_are_refused_with_each_key():
    old, new = _cfg(), _cfg(model__builtin="tiny", quant__scheme="w8a8-int8", trainer__steps=7)
    with pytest.raises(ValueError) as e:
        check_config_change(old, new, "the config in CKPT", allow=False)
    msg = str(e.value)
    assert "model.builtin: 'small' -> 'tiny'" in msg and "quant.scheme: 'w4a16' -> 'w8a8-int8'" in msg
    assert "trainer.steps" not in msg  # not a fixed setting
    assert "--allow-config-change" in msg and "CKPT" in msg
    notices = check_config_change(old, new, "x", allow=True)
    assert len(notices) == 3 and any("trainer.steps changed 100 -> 7" in n for n in notices)


def test_free_changes_are_accepted_and_named():
    notices = check_config_change(_cfg(), _cfg(trainer__eval_every=5, data__reward_workers=0,
                                               algo__advantage="rloo", trainer__run_dir="elsewhere"), "x", False)
    assert sorted(n.split()[1] for n in notices) == ["algo.advantage", "data.reward_workers", "trainer.eval_every"]


def test_adding_a_critic_is_refused():
    with pytest.raises(ValueError, match="algo.advantage: 'grpo' -> 'gae'"):
        check_config_change(_cfg(), _cfg(algo__advantage="gae"), "x", allow=False)


def test_keys_the_old_run_lacked_are_skipped():
    old = _cfg()
    del old["trainer"]["keep_last"]
    assert config_changes(old, _cfg(trainer__keep_last=9)) == []


def test_existing_run(tmp_path):
    assert existing_run(tmp_path) is None
    (tmp_path / "warmstart").mkdir()  # the warm-start cache alone is not a run
    assert existing_run(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("")
    assert "no checkpoint was written" in existing_run(tmp_path)
    ckpt.save_checkpoint(tmp_path, 3, {"step": 3})
    assert existing_run(tmp_path) == "checkpoint step_000003"


def test_torn_last_line_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    warnings = []
    assert read_jsonl(path, warnings.append) == [{"step": 1}, {"step": 2}]
    assert len(warnings) == 1 and str(path) in warnings[0]
    truncate_after(path, 1, warnings.append)
    assert path.read_text() == '{"step": 1}\n'


def test_bad_middle_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2 "):
        read_jsonl(path)


def test_unreadable_checkpoints(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, {"step": step, "data_pos": 0, "learner": {}, "rng": {}})
    latest = ckpt.latest_checkpoint(tmp_path) / "state.pt"
    latest.write_bytes(latest.read_bytes()[:20])
    path, state, bad = ckpt.load_latest_intact(tmp_path)
    assert path.name == "step_000001" and state["step"] == 1 and [p.name for p, _ in bad] == ["step_000002"]
    (path / "meta.json").write_text("{")
    with pytest.raises(ckpt.CheckpointUnreadable, match="step_000002.*step_000001"):
        ckpt.load_latest_intact(tmp_path)


def _plain_progress(total: int, start: int = 0) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    with StepProgress(total, start, console) as p:
        for step in range(start + 1, total + 1):
            p.update(step, {"reward/mean": 0.25, "mismatch/kl_k3": 1e-3})
    return out.getvalue().splitlines()


def test_plain_progress_cadence():
    lines = _plain_progress(100)
    steps = [int(ln.split()[2].split("/")[0]) for ln in lines]
    assert steps == [1] + list(range(5, 101, 5))  # first, every total // 20, last
    assert all("reward 0.250" in ln and "kl3 1.00e-03" in ln and "eta" in ln for ln in lines)
    assert [ln.split()[2] for ln in _plain_progress(7, start=5)] == ["6/7", "7/7"]  # resumed: first and last
    assert _plain_progress(3) and len(_plain_progress(3)) == 3


def test_quiet_progress_prints_nothing(capsys):
    with StepProgress(10, 0, console=None) as p:
        p.update(1, {})
    assert capsys.readouterr() == ("", "")


def test_memory_options_on_resume():
    """Activation checkpointing recomputes the same values: accepted. The moments' dtype is the
    optimizer state's layout: refused like the other optimizer settings."""
    notices = check_config_change(_cfg(), _cfg(trainer__activation_checkpointing=True), "x", allow=False)
    assert notices == ["resume: trainer.activation_checkpointing changed False -> True"]
    with pytest.raises(ValueError, match="optim.state_dtype: 'float32' -> 'bfloat16'"):
        check_config_change(_cfg(), _cfg(optim__state_dtype="bfloat16"), "x", allow=False)
    assert check_config_change(_cfg(), _cfg(optim__state_dtype="bfloat16"), "x", allow=True)
