"""Configuration: frozen dataclasses per component and the YAML loader."""

from moetext.config.loader import (
    ConfigError,
    from_dict,
    load,
    save,
    to_dict,
    validate,
    validate_for_devices,
)
from moetext.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    KernelsConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ShardingConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "KernelsConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ShardingConfig",
    "TrainConfig",
    "from_dict",
    "load",
    "save",
    "to_dict",
    "validate",
    "validate_for_devices",
]
