"""Sharding: logical axis names (used by layers) mapped to device-mesh axes by rules."""

from moetext.sharding import logical
from moetext.sharding.logical import constrain, current, logical_to_mesh_spec, use_rules

__all__ = ["constrain", "current", "logical", "logical_to_mesh_spec", "use_rules"]
