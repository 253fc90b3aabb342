"""Mixture-of-Experts feed-forward: router, dispatch (dropless / capacity), experts, block."""

from moetext.models.moe.block import AUX_KEYS, MoEBlock, zero_aux
from moetext.models.moe.experts import Experts
from moetext.models.moe.router import Router, load_balance_loss, route, router_z_loss

__all__ = [
    "AUX_KEYS",
    "Experts",
    "MoEBlock",
    "Router",
    "load_balance_loss",
    "route",
    "router_z_loss",
    "zero_aux",
]
