"""Config loading: YAML + dotted overrides, typed, with errors that name the key."""

from __future__ import annotations

import pytest

from quarl.config import RunConfig, load_run_config
from quarl.configuration import ConfigError, parse_overrides


def test_defaults_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  temperature: 0.7\n  n: 4\nquant:\n  scheme: w8a8-fp8\n")
    cfg = load_run_config(str(f), ["--rollout.temperature=0.9", "--optim.lr", "3e-6", "--trainer.on_policy=true",
                                   "--quant.exclude=layers.0.*,layers.1.*"])
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.temperature == 0.9 and cfg.rollout.n == 4
    assert cfg.quant.scheme == "w8a8-fp8"
    assert cfg.optim.lr == 3e-6 and cfg.trainer.on_policy is True
    assert cfg.quant.exclude == ["layers.0.*", "layers.1.*"]
    assert cfg.algo.eps_low is None
    assert load_run_config(None, ["--algo.eps_low=none"]).algo.eps_low is None


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature' \(did you mean 'temperature'\?\)"):
        load_run_config(None, ["--rollout.temprature=1.0"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rolout'.*'rollout'"):
        load_run_config(None, ["--rolout.n=2"])


def test_wrong_type_and_bad_literal():
    with pytest.raises(ConfigError, match=r"rollout.n: expected an integer, got 'four'"):
        load_run_config(None, ["--rollout.n=four"])
    with pytest.raises(ConfigError, match=r"quant.mode: 'fast' is not one of 'bf16', 'rollout', 'aligned'"):
        load_run_config(None, ["--quant.mode=fast"])
    with pytest.raises(ConfigError, match=r"trainer.on_policy: expected true/false"):
        load_run_config(None, ["--trainer.on_policy=maybe"])


def test_malformed_yaml_names_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rollout:\n  n: 4\n  temperature: [1.0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: malformed YAML at line \d+"):
        load_run_config(str(f))


def test_yaml_unknown_nested_key(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  learning_rate: 1e-5\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'"):
        load_run_config(str(f))


def test_override_parsing_errors():
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--rollout.n"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["rollout.n=3"])


def test_example_configs_load():
    from pathlib import Path

    examples = sorted(Path(__file__).resolve().parent.parent.glob("examples/*.yaml"))
    assert examples
    for f in examples:
        cfg = load_run_config(str(f), ["--model.path=/models/x", "--data.path=train.jsonl"])
        assert cfg.data.task == "file" and cfg.optim.lr == 1e-6, f
