"""Checks that span config sections (each section checks its own fields in `__post_init__`).

`validate(cfg)` runs on every load; `validate_for_devices(cfg, n)` once the device count is
known; `validate_paths(cfg)` when a training run starts, before anything is written. Every
failure is a ConfigError naming the fields and their values.
"""

from __future__ import annotations

from moetext import paths
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


def validate_paths(cfg: Config) -> None:
    """The paths a training run reads exist and the run dir can be written (PathError naming
    the key and the path); run by `python -m train` before anything is created. The values
    are absolute already (`load` resolved them)."""
    paths.writable_dir(cfg.train.run_dir, "train.run_dir")
    if cfg.train.compilation_cache_dir not in (None, "auto"):
        paths.writable_dir(cfg.train.compilation_cache_dir, "train.compilation_cache_dir")
    d = cfg.data
    if d.kind == "tfds":
        if d.data_dir is not None and d.name == "python_docs":  # prepared there on first use
            paths.writable_dir(d.data_dir, "data.data_dir")
        elif d.data_dir is not None:
            paths.existing_dir(d.data_dir, "data.data_dir")
        if d.tokenizer is not None:
            paths.existing(d.tokenizer, "data.tokenizer")
    source = cfg.checkpoint.load_params_from
    # Ignored once the run has checkpoints (it resumes): only a new run reads it.
    if (
        source is not None
        and not paths.as_epath(cfg.train.run_dir).joinpath("checkpoints").exists()
    ):
        paths.existing_dir(source, "checkpoint.load_params_from")
