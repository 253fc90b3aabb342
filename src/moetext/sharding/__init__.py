"""Sharding: logical axis names (used by layers) mapped to device-mesh axes by YAML rules."""

from moetext.sharding import logical
from moetext.sharding.logical import constrain, current, logical_to_mesh_spec, use_rules
from moetext.sharding.mesh import initialize_distributed, make_mesh
from moetext.sharding.plan import Plan, make_plan, record_logical_names
from moetext.sharding.rules import available_presets, load_preset

__all__ = [
    "Plan",
    "available_presets",
    "constrain",
    "current",
    "initialize_distributed",
    "load_preset",
    "logical",
    "logical_to_mesh_spec",
    "make_mesh",
    "make_plan",
    "record_logical_names",
    "use_rules",
]
