"""Routers: hidden states -> each token's K experts and weights, plus auxiliary losses and
metrics, behind one registry (`moe.router: <name>`).

    router = build_router(cfg.moe, emb_dim=..., init_std=..., param_dtype=..., rngs=...)
    routing = router(x_TD, segment_ids_BS=seg)  # weights_TK, ids_TK, moe_loss, losses, metrics
    router.update_state(metrics)    # non-parameter state, after the optimizer update

The contract and registry are in base.py; each router is one module that registers itself
(`@register_router("name")`) and is imported below: softmax_topk, sigmoid_topk (both
`GateRouter`s, gate.py).
"""

from moetext.models.moe.routers import sigmoid_topk, softmax_topk  # noqa: F401  (register)
from moetext.models.moe.routers.base import (
    COUNTS_KEY,
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
from moetext.models.moe.routers.gate import GateRouter
from moetext.models.moe.routers.losses import (
    SCOPES,
    balance_loss,
    expert_counts,
    expert_load,
    load_balance_loss,
    router_z_loss,
    sequence_balance_loss,
)
from moetext.models.moe.routers.select import group_mask, select_experts
from moetext.models.moe.routers.sigmoid_topk import BIAS_KEY, SigmoidTopK
from moetext.models.moe.routers.softmax_topk import SoftmaxTopK, route

__all__ = [
    "BIAS_KEY",
    "COUNTS_KEY",
    "GateRouter",
    "SCOPES",
    "SigmoidTopK",
    "balance_loss",
    "expert_counts",
    "group_mask",
    "select_experts",
    "sequence_balance_loss",
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
