"""Routers: hidden states -> each token's K experts and weights, plus auxiliary losses and
metrics, behind one registry (`moe.router: <name>`).

    router = build_router(cfg.moe, emb_dim=..., init_std=..., param_dtype=..., rngs=...)
    routing = router(x_TD)          # Routing(weights_TK, ids_TK, moe_loss, losses, metrics)
    router.update_state(metrics)    # non-parameter state, after the optimizer update

The contract and registry are in base.py; each router is one module that registers itself
(`@register_router("name")`) and is imported below: softmax_topk.
"""

from moetext.models.moe.routers import softmax_topk  # noqa: F401  (register)
from moetext.models.moe.routers.base import (
    LOAD_KEY,
    LOSS_KEYS,
    Router,
    RouterBuilder,
    Routing,
    available_routers,
    build_router,
    get_router,
    register_router,
)
from moetext.models.moe.routers.losses import expert_load, load_balance_loss, router_z_loss
from moetext.models.moe.routers.softmax_topk import SoftmaxTopK, route

__all__ = [
    "LOAD_KEY",
    "LOSS_KEYS",
    "Router",
    "RouterBuilder",
    "Routing",
    "SoftmaxTopK",
    "available_routers",
    "build_router",
    "expert_load",
    "get_router",
    "load_balance_loss",
    "register_router",
    "route",
    "router_z_loss",
]
