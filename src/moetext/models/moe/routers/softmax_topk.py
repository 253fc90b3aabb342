"""`softmax_topk`: softmax over the experts' logits, then the K most probable (Qwen2/3-MoE,
Mixtral, Switch), with the Switch load-balancing loss and the ST-MoE z-loss. With moe.n_group
> 1 only each token's topk_group groups with the highest top probability are eligible
(DeepSeek-V2's group_limited_greedy).

Legend: T tokens (B*S flattened), E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moetext.models.moe.routers.base import register_router
from moetext.models.moe.routers.gate import GateRouter


@register_router("softmax_topk")
class SoftmaxTopK(GateRouter):
    """probs = softmax(logits) in float32; top-k of probs; weights = the chosen probs
    (renormalised under norm_topk_prob, without an epsilon, as Qwen does)."""

    group_score = "max"

    def affinities(self, logits_TE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
        return probs_TE, probs_TE, probs_TE


def route(
    logits_TE: jax.Array, k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax over experts, then top-k (ties go to the lower expert id), without groups.

    Returns weights_TK float32 (renormalised to sum to 1 when norm_topk_prob), ids_TK int32 and
    the full probabilities probs_TE float32 (for the load-balancing loss).
    """
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, ids_TK.astype(jnp.int32), probs_TE
