"""Checks that span config sections (each section checks its own fields in `__post_init__`).

`validate(cfg)` runs on every load; `validate_for_devices(cfg, n)` once the device count is
known. Every failure is a ConfigError naming the fields and their values.
"""

from __future__ import annotations

from moetext.config import presets
from moetext.config.schema import Config
from moetext.errors import ConfigError


def validate(cfg: Config) -> None:
    """Cross-section checks that need no devices."""
    k, moe = cfg.kernels, cfg.moe
    if k.quantization != "none" and moe.dispatch != "dropless":
        raise ConfigError(
            f"kernels.quantization={k.quantization!r} needs moe.dispatch='dropless' (the grouped "
            f"matmuls it quantizes); moe.dispatch={moe.dispatch!r} runs plain einsums"
        )
    if cfg.data.eval_batches < 1 and cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} needs data.eval_batches >= 1, "
            f"got {cfg.data.eval_batches}"
        )
    b, n = cfg.data.global_batch_size, cfg.train.grad_accum_steps
    if b % n:
        raise ConfigError(
            f"data.global_batch_size={b} is not divisible by train.grad_accum_steps={n}: "
            f"every micro-batch needs the same number of rows"
        )
    presets.resolve(cfg.sharding)  # preset exists, axes known, sizes valid, at most one -1


def validate_for_devices(cfg: Config, num_devices: int) -> None:
    """Checks that depend on how many devices the run has."""
    if cfg.data.global_batch_size % num_devices:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by the "
            f"{num_devices} devices of this run; use a multiple of {num_devices}"
        )
    b, n = cfg.data.global_batch_size, cfg.train.grad_accum_steps
    if n > 1 and (b // n) % num_devices:
        # Each micro-batch is split over the devices like the batch (train/step.py).
        raise ConfigError(
            f"data.global_batch_size={b} in train.grad_accum_steps={n} micro-batches gives "
            f"{b // n} rows each, not divisible by the {num_devices} devices of this run; use "
            f"a global batch that is a multiple of {n * num_devices}"
        )
    presets.axis_sizes(presets.resolve(cfg.sharding), num_devices)  # product == devices
