"""Logical-axis rules at run time: every logical name a param or activation uses must have a
rule in the preset. The presets themselves (YAML, parsing, checks) are config:
`moetext.config.presets`, re-exported here."""

from __future__ import annotations

from collections.abc import Iterable

from moetext.config.presets import (
    PRESET_DIR,
    MeshTarget,
    Preset,
    Rule,
    available_presets,
    load_preset,
    resolve,
)
from moetext.errors import ConfigError

__all__ = [
    "PRESET_DIR",
    "MeshTarget",
    "Preset",
    "Rule",
    "available_presets",
    "check_covered",
    "load_preset",
    "resolve",
]


def check_covered(names: Iterable[str | None], preset: Preset, where: str) -> None:
    """Every logical name must have a rule (map it to null to replicate): a typo never silently
    replicates a weight."""
    known = preset.rule_names()
    for name in names:
        if name is not None and name not in known:
            raise ConfigError(
                f"logical axis {name!r} of {where} has no rule in sharding preset "
                f"{preset.name!r} (rules name: {', '.join(sorted(known))}); add "
                f"[{name}, <mesh axis>] to logical_axis_rules, or [{name}, null] to replicate it"
            )
