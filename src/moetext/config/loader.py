"""YAML -> frozen `Config`: `base_config` inheritance, dotted CLI overrides, strict typing.

Every mistake fails here, before anything compiles: an unknown key names the nearest
valid one, a wrong type names the key, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moetext.config.schema import Config


class ConfigError(ValueError):
    """A config that cannot be loaded: unknown key, wrong type, missing file, bad value."""


def _shipped_configs() -> Path:
    # Package data (the repository's configs/ links here), so a wheel install has them too.
    root = importlib.resources.files("moetext") / "configs"
    return root if isinstance(root, Path) else Path(str(root))


SHIPPED_CONFIGS = _shipped_configs()
"""base.yml, models/*.yml and sharding/*.yml as shipped with moetext."""


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> Config:
    """Loads `path` (following `base_config` chains) and applies `section.key=value` overrides.

    A relative `configs/...` path that does not exist here names a shipped config, so
    `python -m train configs/models/tiny-qwen3-moe.yml` works from any directory.
    """
    raw = _load_yaml_tree(_locate(path), seen=())
    for item in overrides:
        key, value = _split_override(item)
        _set_dotted(raw, key, value)
    cfg = from_dict(raw)
    validate(cfg)
    return cfg


def from_dict(raw: dict[str, Any]) -> Config:
    return _build(Config, raw, prefix="")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML-friendly dict (tuples become lists)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


def save(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the resolved config as YAML (local or any etils.epath filesystem, e.g. gs://)."""
    from etils import epath

    out = epath.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def validate(cfg: Config) -> None:
    """Cross-field checks that need no devices."""
    m, moe, d = cfg.model, cfg.moe, cfg.data
    for name, value in [
        ("model.vocab_size", m.vocab_size),
        ("model.emb_dim", m.emb_dim),
        ("model.num_layers", m.num_layers),
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.head_dim", m.head_dim),
        ("moe.num_experts", moe.num_experts),
        ("moe.num_experts_per_tok", moe.num_experts_per_tok),
        ("moe.moe_intermediate_size", moe.moe_intermediate_size),
        ("data.seq_len", d.seq_len),
        ("data.global_batch_size", d.global_batch_size),
        ("train.log_every", cfg.train.log_every),
        ("checkpoint.every", cfg.checkpoint.every),
        ("model.decoder_sparse_step", m.decoder_sparse_step),
    ]:
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    if moe.num_experts_per_tok > moe.num_experts:
        raise ConfigError(
            f"moe.num_experts_per_tok={moe.num_experts_per_tok} exceeds "
            f"moe.num_experts={moe.num_experts}: a token cannot pick more experts than exist"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
            f"{m.num_kv_heads}: grouped-query attention needs whole groups"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even for RoPE")
    bad = [i for i in m.mlp_only_layers if not 0 <= i < m.num_layers]
    if bad:
        raise ConfigError(f"model.mlp_only_layers {bad} out of range [0, {m.num_layers})")
    if cfg.train.steps < 0:
        raise ConfigError(f"train.steps must be >= 0, got {cfg.train.steps}")
    if cfg.train.skip_nonfinite_steps < 0:
        raise ConfigError(
            f"train.skip_nonfinite_steps must be >= 0, got {cfg.train.skip_nonfinite_steps}"
        )
    if cfg.train.profile_steps is not None:
        start, stop = cfg.train.profile_steps
        if not 1 <= start < stop:
            raise ConfigError(
                f"train.profile_steps={[start, stop]} must be [start, stop] with "
                f"1 <= start < stop (steps as the log numbers them, stop exclusive)"
            )
    if any(i < 0 for i in cfg.train.profile_processes):
        raise ConfigError(
            f"train.profile_processes={list(cfg.train.profile_processes)} must hold process "
            f"indices >= 0"
        )
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep must be >= 1, got {cfg.checkpoint.keep}")
    if moe.capacity_factor <= 0:
        raise ConfigError(f"moe.capacity_factor must be positive, got {moe.capacity_factor}")
    k = cfg.kernels
    if k.quantization != "none" and moe.dispatch != "dropless":
        raise ConfigError(
            f"kernels.quantization={k.quantization!r} needs moe.dispatch='dropless' (the grouped "
            f"matmuls it quantizes); moe.dispatch={moe.dispatch!r} runs plain einsums"
        )
    if k.qag and k.quantization != "fp8_blockwise":
        raise ConfigError(
            f"kernels.qag=true all-gathers FP8 expert weights, so it needs "
            f"kernels.quantization='fp8_blockwise', got {k.quantization!r}"
        )
    _validate_data(cfg)
    _validate_sharding(cfg)


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    if d.kind == "tfds" and not d.name:
        raise ConfigError(
            "data.kind='tfds' needs data.name: the dataset prepared with "
            "`python -m moetext.data.prepare --name NAME`, or python_docs (the embedded corpus)"
        )
    if d.eval_batches < 1 and cfg.train.eval_every:
        raise ConfigError(
            f"train.eval_every={cfg.train.eval_every} needs data.eval_batches >= 1, "
            f"got {d.eval_batches}"
        )
    if d.prefetch < 1:
        raise ConfigError(f"data.prefetch must be >= 1, got {d.prefetch}")


def _validate_sharding(cfg: Config) -> None:
    from moetext.sharding import rules  # lazy: the sharding package imports jax

    rules.resolve(cfg.sharding)  # preset exists, axes known, sizes valid, at most one -1
    dist = cfg.distributed
    if dist.num_processes is not None and dist.num_processes < 1:
        raise ConfigError(f"distributed.num_processes must be >= 1, got {dist.num_processes}")
    if dist.num_processes is not None and dist.process_id is not None:
        if not 0 <= dist.process_id < dist.num_processes:
            raise ConfigError(
                f"distributed.process_id={dist.process_id} is outside "
                f"[0, distributed.num_processes={dist.num_processes})"
            )


def validate_for_devices(cfg: Config, num_devices: int) -> None:
    """Checks that depend on how many devices the run has."""
    if cfg.data.global_batch_size % num_devices:
        raise ConfigError(
            f"data.global_batch_size={cfg.data.global_batch_size} is not divisible by the "
            f"{num_devices} devices of this run; use a multiple of {num_devices}"
        )
    from moetext.sharding import mesh, rules

    mesh.axis_sizes(rules.resolve(cfg.sharding), num_devices)  # mesh product == device count


# --- YAML tree -------------------------------------------------------------------------------


def _locate(path: str | os.PathLike) -> Path:
    """`path` itself, or the shipped config it names when it is a relative `configs/...` path
    that does not exist relative to the working directory."""
    given = Path(path)
    if given.exists() or not _names_shipped(given):
        return given
    shipped = SHIPPED_CONFIGS.joinpath(*given.parts[1:])
    return shipped if shipped.exists() else given


def _names_shipped(path: Path) -> bool:
    return not path.is_absolute() and path.parts[:1] == ("configs",)


def _load_yaml_tree(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        hint = ""
        if not seen and _names_shipped(path):
            shipped = sorted((SHIPPED_CONFIGS / "models").glob("*.yml"))
            names = ", ".join(f"configs/models/{p.name}" for p in shipped)
            hint = f", nor among the configs shipped with moetext ({names or SHIPPED_CONFIGS})"
        raise ConfigError(f"config file not found: {str(path)!r}{hint}")
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"base_config cycle: {chain}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base_config", None)
    if base is None:
        return data
    bases = [base] if isinstance(base, str) else list(base)
    merged: dict[str, Any] = {}
    for b in bases:
        merged = _deep_merge(merged, _load_yaml_tree(path.parent / b, seen + (path,)))
    return _deep_merge(merged, data)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "mesh":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _split_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) < 2:
        raise ConfigError(
            f"override key {key!r} must name a section and a field, e.g. train.steps=10; "
            f"sections: {', '.join(f.name for f in dataclasses.fields(Config))}"
        )
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key!r}: {p!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


# --- typed decoding --------------------------------------------------------------------------


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean {prefix + near[0]!r}?" if near else ""
            raise ConfigError(
                f"unknown config key {prefix + str(key)!r}{hint} (valid keys in {where}: "
                f"{', '.join(names)})"
            )
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def fail():
        raise ConfigError(
            f"config key {key!r}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )

    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError:
                pass
        fail()
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"config key {key!r}: expected one of {list(args)}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            fail()
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, key) for v in value)
        if len(value) != len(args):
            fail()
        return tuple(_coerce(a, v, key) for a, v in zip(args, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            fail()
        return {str(k): _coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        fail()
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string
            try:
                return float(value)
            except ValueError:
                pass
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        fail()
    if tp is Any:
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # schema bug
