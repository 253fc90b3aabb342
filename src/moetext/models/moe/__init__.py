"""Mixture-of-Experts feed-forward: router, dispatch (dropless / capacity; `ep`: expert-parallel
dropless), experts, block."""

from moetext.models.moe.block import AUX_KEYS, LOAD_KEY, MoEBlock, zero_aux
from moetext.models.moe.experts import Experts, gmm_from_config
from moetext.models.moe.router import (
    Router,
    expert_load,
    load_balance_loss,
    route,
    router_z_loss,
)

__all__ = [
    "AUX_KEYS",
    "LOAD_KEY",
    "Experts",
    "MoEBlock",
    "Router",
    "expert_load",
    "gmm_from_config",
    "load_balance_loss",
    "route",
    "router_z_loss",
    "zero_aux",
]
