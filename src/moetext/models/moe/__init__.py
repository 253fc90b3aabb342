"""Mixture-of-Experts feed-forward: routers (a registry: `moe.router`), dispatch (dropless /
capacity; `ep`: expert-parallel dropless), experts, block."""

from moetext.models.moe.block import AUX_KEYS, LOAD_KEY, MoEBlock, zero_aux
from moetext.models.moe.experts import Experts, gmm_from_config
from moetext.models.moe.routers import (
    Router,
    Routing,
    available_routers,
    build_router,
    expert_load,
    get_router,
    load_balance_loss,
    register_router,
    route,
    router_z_loss,
)

__all__ = [
    "AUX_KEYS",
    "LOAD_KEY",
    "Experts",
    "MoEBlock",
    "Router",
    "Routing",
    "available_routers",
    "build_router",
    "expert_load",
    "get_router",
    "gmm_from_config",
    "load_balance_loss",
    "register_router",
    "route",
    "router_z_loss",
    "zero_aux",
]
