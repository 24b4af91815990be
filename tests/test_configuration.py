"""Config loading: YAML + dotted overrides, typed, with errors that name the key."""

from __future__ import annotations

import pytest

from quarl.config import RunConfig, load_run_config
from quarl.config.typed import ConfigError, parse_overrides


def test_defaults_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  temperature: 0.7\n  n: 4\nquant:\n  scheme: w8a8-fp8\n")
    cfg = load_run_config(str(f), ["--rollout.temperature=0.9", "--optim.lr", "3e-6", "--trainer.on_policy=true",
                                   "--quant.exclude=layers.0.*,layers.1.*"])
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.temperature == 0.9 and cfg.rollout.n == 4
    assert cfg.quant.scheme.name == "w8a8-fp8"
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
        assert cfg.data.task == "file" and cfg.optim.lr == (1e-5 if cfg.model.lora_rank else 1e-6), f


def test_the_base_model_recipe_loads_and_its_solutions_are_long():
    from pathlib import Path

    from quarl.tasks.synthetic import ArithmeticTask

    cfg = load_run_config(str(Path(__file__).resolve().parent.parent / "experiments" / "base.yaml"), [])
    assert cfg.model.builtin == "100m" and cfg.data.task == "arith" and cfg.trainer.sft_warmup_steps > 0
    task = ArithmeticTask(difficulty=cfg.data.difficulty, num_train=50, num_eval=1)
    lengths = [len(ex.solution) for ex in task.train_examples()]
    # several hundred characters (= tokens of the built-in tokenizer), within the rollout's budget
    assert 200 < min(lengths) and max(lengths) + 1 <= cfg.rollout.max_new_tokens


def test_quant_mode_and_scheme_are_resolved_once():
    from quarl.config import load_run_config
    from quarl.quant import SCHEMES, QuantMode

    cfg = load_run_config(None, ["--quant.mode=rollout", "--quant.scheme=w8a8-fp8"])
    assert cfg.quant.mode is QuantMode.ROLLOUT and cfg.quant.scheme is SCHEMES["w8a8-fp8"]
    assert load_run_config(None, ["--quant.mode=bf16"]).quant.scheme is SCHEMES["bf16"]  # bf16 mode: nothing quantized
    with pytest.raises(ConfigError, match="quantizes nothing"):
        load_run_config(None, ["--quant.mode=aligned", "--quant.scheme=bf16"])
    with pytest.raises(ConfigError, match="did you mean 'aligned'"):
        load_run_config(None, ["--quant.mode=aligend"])


def test_resolved_config_dumps_to_plain_yaml_and_back(tmp_path):
    import yaml

    from quarl.config import RunConfig, load_run_config
    from quarl.config.typed import dump_yaml

    cfg = load_run_config(None, ["--quant.scheme=nvfp4", "--rollout.engine.block_size=32"])
    text = dump_yaml(cfg)
    data = yaml.safe_load(text)  # plain data only: safe_load would fail on Python objects
    assert data["quant"]["mode"] == "aligned" and data["quant"]["scheme"] == "nvfp4"
    assert data["rollout"]["engine"]["block_size"] == 32
    (tmp_path / "run.yaml").write_text(text)
    assert load_run_config(str(tmp_path / "run.yaml")) == cfg
    assert isinstance(cfg, RunConfig)


def test_moved_rollout_keys_say_where_they_went():
    from quarl.config import load_run_config

    with pytest.raises(ConfigError, match="has moved: use rollout.engine.gpu_memory_utilization"):
        load_run_config(None, ["--rollout.kv_cache_fraction=0.5"])
    with pytest.raises(ConfigError, match="use rollout.engine.block_size"):
        load_run_config(None, ["--rollout.block_size=8"])
    with pytest.raises(ConfigError, match="set by the trainer"):
        load_run_config(None, ["--rollout.engine.max_model_len=512"])


def test_an_older_runs_config_file_still_loads(tmp_path):
    """config.yaml written before rollout.engine existed: its values land in the new keys."""
    from quarl.config import load_run_config
    from quarl.config.run import upgrade

    old = tmp_path / "config.yaml"
    old.write_text("rollout:\n  n: 4\n  kv_cache_fraction: 0.5\n  num_kv_blocks: 512\n  block_size: 32\n"
                   "  max_num_seqs: 64\n  cuda_graphs: false\n  release_kv_cache: false\n"
                   "quant:\n  mode: bf16\n  scheme: w4a16\n")
    cfg = load_run_config(str(old), ["--trainer.steps=3"])
    e = cfg.rollout.engine
    assert (e.gpu_memory_utilization, e.block_size, e.max_num_seqs, e.cuda_graphs) == (0.5, 32, 64, False)
    assert e.num_kv_blocks is None  # 512 was the old CPU default, not a cap
    assert cfg.rollout.kv_cache_in_update == "keep" and cfg.rollout.n == 4 and cfg.trainer.steps == 3
    assert cfg.quant.scheme.name == "bf16"
    assert upgrade({"rollout": {"release_kv_cache": True}})["rollout"] == {"engine": {}}  # old default: today's auto
    with pytest.raises(ConfigError, match="has moved"):  # typed by hand in the old layout: told where it went
        load_run_config(None, ["--rollout.kv_cache_fraction=0.5"])


def test_a_nested_override_keeps_the_parents_defaults_for_the_other_keys(tmp_path):
    """Setting one rollout.engine key (CLI or YAML) leaves the trainer's engine defaults (a
    0.35 memory share, not EngineConfig's own 0.85) on every other key."""
    cfg = load_run_config(None, ["--rollout.engine.block_size=32"])
    assert cfg.rollout.engine.block_size == 32 and cfg.rollout.engine.gpu_memory_utilization == 0.35
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  engine:\n    max_num_seqs: 64\n")
    cfg = load_run_config(path, [])
    assert cfg.rollout.engine.max_num_seqs == 64 and cfg.rollout.engine.gpu_memory_utilization == 0.35
