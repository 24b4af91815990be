"""Configuration: ``run.py`` holds the run config of ``quarl train`` (one dataclass per
package), ``typed.py`` the machinery that builds typed dataclasses from YAML and dotted
CLI flags."""

from quarl.config.run import (
    AlgoConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    QuantConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    load_run_config,
)
from quarl.config.typed import ConfigError, dump_yaml, to_dict

__all__ = [
    "AlgoConfig", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig", "QuantConfig", "RolloutConfig",
    "RunConfig", "TrainerConfig", "dump_yaml", "load_run_config", "to_dict",
]
