"""Sharding presets: YAML files of mesh axes, default mesh sizes and logical-axis rules.

A preset (configs/sharding/<name>.yml) holds

    mesh_axes: [data, fsdp, expert, tensor]      # outermost (slowest links) first
    mesh: {data: 1, fsdp: -1, expert: 1, tensor: 1}
    dcn_mesh: {data: 1, fsdp: 1, expert: 1, tensor: 1}
    logical_axis_rules:
      - [batch, [data, fsdp, expert]]            # logical name -> mesh axis | [axes] | null
      - [embed, fsdp]

`resolve(sharding_cfg)` merges a run's `sharding.mesh` / `sharding.dcn_mesh` overrides into the
preset and checks them; `axis_sizes(preset, num_devices)` fills the -1 for a device count.
Every mistake is a ConfigError naming the preset, axis or rule. Presets are config (plain YAML,
no jax): `moetext.sharding` turns them into meshes and shardings.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import yaml

from moetext.config.schema import ShardingConfig
from moetext.config.shipped import SHIPPED_CONFIGS
from moetext.errors import ConfigError

PRESET_DIR = SHIPPED_CONFIGS / "sharding"

MeshTarget = str | tuple[str, ...] | None
Rule = tuple[str, MeshTarget]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    mesh_axes: tuple[str, ...]
    mesh: dict[str, int]  # ICI size per axis (one slice); at most one -1
    dcn_mesh: dict[str, int]  # size per axis across slices
    rules: tuple[Rule, ...]

    def rule_names(self) -> set[str]:
        return {name for name, _ in self.rules}

    def num_slices(self) -> int:
        n = 1
        for size in self.dcn_mesh.values():
            n *= size
        return n


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yml"))


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (configs/sharding/<name>.yml) or by path to a YAML file."""
    path = Path(name_or_path)
    if not (name_or_path.endswith((".yml", ".yaml")) or os.sep in name_or_path):
        path = PRESET_DIR / f"{name_or_path}.yml"
    if not path.is_file():
        raise ConfigError(
            f"unknown sharding.preset {name_or_path!r}; valid presets: "
            f"{', '.join(available_presets())} (or a path to a preset .yml file)"
        )
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    return _parse(raw, name=str(name_or_path))


def resolve(cfg: ShardingConfig) -> Preset:
    """The run's preset with its `sharding.mesh` and `sharding.dcn_mesh` overrides applied."""
    preset = load_preset(cfg.preset)
    mesh = _merge_sizes(preset, preset.mesh, cfg.mesh, "sharding.mesh", allow_fill=True)
    dcn = _merge_sizes(preset, preset.dcn_mesh, cfg.dcn_mesh, "sharding.dcn_mesh", allow_fill=False)
    return dataclasses.replace(preset, mesh=mesh, dcn_mesh=dcn)


def axis_sizes(preset: Preset, num_devices: int) -> tuple[dict[str, int], dict[str, int]]:
    """(ici, dcn) sizes per axis with the -1 filled; ConfigError when they cannot cover
    `num_devices` exactly."""
    dcn = dict(preset.dcn_mesh)
    slices = math.prod(dcn.values())
    ici = dict(preset.mesh)

    def desc(sizes: dict[str, int]) -> str:
        return " x ".join(f"{a}={sizes[a]}" for a in preset.mesh_axes)

    if num_devices % slices:
        raise ConfigError(
            f"sharding.dcn_mesh {desc(dcn)} asks for {slices} slices, which does not divide "
            f"the {num_devices} devices of this run"
        )
    per_slice = num_devices // slices
    fill = [a for a, s in ici.items() if s == -1]
    fixed = math.prod(s for s in ici.values() if s != -1)
    if fill:
        if per_slice % fixed:
            raise ConfigError(
                f"sharding.mesh {desc(ici)}: the fixed axes take {fixed} devices per slice, "
                f"which does not divide the {per_slice} devices per slice ({num_devices} devices "
                f"/ {slices} slices), so {fill[0]}=-1 cannot fill the rest"
            )
        ici[fill[0]] = per_slice // fixed
    if math.prod(ici.values()) != per_slice:
        raise ConfigError(
            f"sharding.mesh {desc(ici)} (preset {preset.name!r}) covers "
            f"{math.prod(ici.values())} devices per slice x {slices} slice(s), but this run has "
            f"{num_devices} devices; make the product {per_slice} or set one axis to -1"
        )
    return ici, dcn


# --- parsing ---------------------------------------------------------------------------------


def _parse(raw: Any, name: str) -> Preset:
    where = f"sharding preset {name!r}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a mapping, got {raw!r}")
    valid = {"mesh_axes", "mesh", "dcn_mesh", "logical_axis_rules"}
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid keys: {sorted(valid)}")
    axes = raw.get("mesh_axes")
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise ConfigError(f"{where}: mesh_axes must be a list of distinct names, got {axes!r}")
    axes = tuple(axes)
    mesh = _sizes(raw.get("mesh") or {}, axes, f"{where} mesh", allow_fill=True)
    dcn = _sizes(raw.get("dcn_mesh") or {}, axes, f"{where} dcn_mesh", allow_fill=False)
    rules = tuple(_rule(r, axes, where) for r in raw.get("logical_axis_rules") or ())
    if not rules:
        raise ConfigError(f"{where}: logical_axis_rules is empty")
    return Preset(name, axes, mesh, dcn, rules)


def _sizes(raw: Any, axes: tuple[str, ...], where: str, allow_fill: bool) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of axis -> size, got {raw!r}")
    sizes = {a: 1 for a in axes}
    for axis, size in raw.items():
        _check_axis(axis, axes, where)
        sizes[axis] = _check_size(size, f"{where}.{axis}", allow_fill)
    _check_one_fill(sizes, where)
    return sizes


def _merge_sizes(
    preset: Preset,
    base: dict[str, int],
    overrides: dict[str, int],
    where: str,
    allow_fill: bool,
) -> dict[str, int]:
    sizes = dict(base)
    for axis, size in overrides.items():
        _check_axis(axis, preset.mesh_axes, f"{where} (preset {preset.name!r})")
        sizes[axis] = _check_size(size, f"{where}.{axis}", allow_fill)
    _check_one_fill(sizes, f"{where} merged with preset {preset.name!r}")
    return sizes


def _check_axis(axis: Any, axes: tuple[str, ...], where: str) -> None:
    if axis not in axes:
        raise ConfigError(f"{where}: unknown mesh axis {axis!r}; valid axes: {', '.join(axes)}")


def _check_size(size: Any, where: str, allow_fill: bool) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        if size >= 1 or (allow_fill and size == -1):
            return size
    expected = "a positive integer or -1 (fill)" if allow_fill else "a positive integer"
    raise ConfigError(f"{where}: expected {expected}, got {size!r}")


def _check_one_fill(sizes: dict[str, int], where: str) -> None:
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"{where}: more than one axis is -1 ({', '.join(f'{a}=-1' for a in fill)}); only "
            f"one axis can take the remaining devices: give the others sizes, e.g. "
            f"sharding.mesh.{fill[0]}=1"
        )


def _rule(raw: Any, axes: tuple[str, ...], where: str) -> Rule:
    if not (isinstance(raw, list | tuple) and len(raw) == 2 and isinstance(raw[0], str)):
        raise ConfigError(
            f"{where}: each logical_axis_rules entry is [logical_name, mesh_axis | [mesh axes] "
            f"| null], got {raw!r}"
        )
    name, target = raw
    if target is None:
        return name, None
    targets = (target,) if isinstance(target, str) else tuple(target)
    for t in targets:
        if t not in axes:
            raise ConfigError(
                f"{where}: rule {raw!r} maps {name!r} to unknown mesh axis {t!r}; "
                f"valid axes: {', '.join(axes)}"
            )
    return name, targets[0] if len(targets) == 1 else targets
