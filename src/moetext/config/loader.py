"""YAML -> frozen `Config`: `base_config` inheritance, dotted CLI overrides, strict typing.

Every mistake fails here, before anything compiles: an unknown key names the nearest
valid one, a wrong type names the key, the expected type and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from moetext import paths
from moetext.config import families
from moetext.config.schema import Config, ModelConfig
from moetext.config.shipped import SHIPPED_CONFIGS
from moetext.config.validate import validate
from moetext.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def load(path: str | os.PathLike[str], overrides: typing.Sequence[str] = ()) -> Config:
    """Loads `path` (following `base_config` chains), applies `section.key=value` overrides and
    runs the cross-section checks (`validate`); every mistake is a ConfigError.

    A relative `configs/...` path that does not exist here names a shipped config, so
    `python -m train configs/models/tiny-qwen3-moe.yml` works from any directory.
    """
    raw = _load_yaml_tree(_locate(path), seen=())
    for item in overrides:
        key, value = _split_override(item)
        _set_dotted(raw, key, value)
    cfg = resolve_paths(from_dict(raw))
    validate(cfg)
    return cfg


# Config keys holding a path: `load` makes them absolute (moetext.paths.resolve: `~` expanded,
# relative to the working directory, URIs kept), so a run records where its files really are
# and every reader (orbax, TFDS, sentencepiece) gets the same absolute path.
PATH_KEYS = (
    "train.run_dir",
    "data.data_dir",
    "data.tokenizer",
    "checkpoint.load_params_from",
    "sharding.preset",
    "train.compilation_cache_dir",
)


def resolve_paths(cfg: Config) -> Config:
    """`cfg` with the values of PATH_KEYS resolved; sharding.preset only when it names a file
    (a path with a directory part or a .yml/.yaml name), not a shipped preset;
    train.compilation_cache_dir unless "auto"."""
    sections: dict[str, Any] = {}
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if (
            value is None
            or (key == "sharding.preset" and not _names_file(value))
            or (key == "train.compilation_cache_dir" and value == "auto")
        ):
            continue
        resolved = paths.resolve(value)
        if resolved != value:
            current = sections.get(section, getattr(cfg, section))
            sections[section] = dataclasses.replace(current, **{name: resolved})
    return cfg.replace(**sections) if sections else cfg


def _names_file(preset: str) -> bool:
    return os.sep in preset or "~" in preset or preset.endswith((".yml", ".yaml"))


def from_dict(raw: dict[str, Any]) -> Config:
    """A `Config` from a plain nested dict, decoded as strictly as `load` (no `validate`)."""
    return _build(Config, raw, prefix="")


def to_dict(cfg: DataclassInstance) -> dict[str, Any]:
    """Plain YAML-friendly dict of a config dataclass (nested ones too; tuples become lists)."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def save(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Writes the resolved config as YAML (local or any etils.epath filesystem, e.g. gs://)."""
    from etils import epath

    out = epath.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --- YAML tree -------------------------------------------------------------------------------


def _locate(path: str | os.PathLike[str]) -> Path:
    """`path` itself, or the shipped config it names when it is a relative `configs/...` path
    that does not exist relative to the working directory."""
    given = Path(os.path.expanduser(path))  # `~`: also where the shell did not expand it
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


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
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


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
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


# Keys that moved (old dotted key -> new one): loading the old one is an error naming the new.
MOVED_KEYS = {
    # The FP8 block-wise recipe's options moved into the recipe section (kernels/quant/).
    "kernels.fp8_block_size": "kernels.recipe.block_size",
    "kernels.fp8_weight_block": "kernels.recipe.weight_block",
    "kernels.fp8_bwd_quantize": "kernels.recipe.bwd_quantize",
    "kernels.qag": "kernels.recipe.qag",
}


# --- typed decoding --------------------------------------------------------------------------


def _build[T: DataclassInstance](cls: type[T], raw: Any, prefix: str) -> T:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    if cls is Config:
        hints.update(_family_hints(raw))
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            _unknown_key(prefix, str(key), names, where)
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _family_hints(raw: dict[str, Any]) -> dict[str, type]:
    """The `model` and `moe` section classes of the family `raw` names (its model.family, else
    the default): fields only another family has are then unknown keys."""
    model = raw.get("model") or {}
    family = model.get("family", ModelConfig.family) if isinstance(model, dict) else None
    sections = families.family_sections(family)
    return {"model": sections.model, "moe": sections.moe}


def _unknown_key(prefix: str, key: str, names: list[str], where: str) -> NoReturn:
    if prefix + key in MOVED_KEYS:
        new = MOVED_KEYS[prefix + key]
        raise ConfigError(
            f"config key {prefix + key!r} has moved to {new!r}; write it there "
            f"({new}=... on the command line)"
        )
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f"; did you mean {prefix + near[0]!r}?" if near else ""
    section = prefix.rstrip(".")
    if section in ("model", "moe") and (others := families.owners(section, key)):
        hint = f": a field of model.family {' / '.join(others)}, not of this one"
    raise ConfigError(
        f"unknown config key {prefix + key!r}{hint} (valid keys in {where}: {', '.join(names)})"
    )


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def fail() -> NoReturn:
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
