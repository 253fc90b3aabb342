"""Configuration: frozen dataclasses per component (each checks itself), the YAML loader, the
cross-section checks (`validate`), the sharding presets (`presets`) and the config reference
rendered from the field docstrings (`docs`, docs/config.md). Imports no other moetext package
but `moetext.errors`."""

from moetext.config.loader import from_dict, load, save, to_dict
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
from moetext.config.validate import validate, validate_for_devices, validate_paths
from moetext.errors import ConfigError

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
    "validate_paths",
]
