"""Top-k softmax router and its auxiliary losses.

Legend: T tokens (B*S flattened), D emb_dim, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.models.layers.params import make_param, normal
from moetext.models.layers.project import project

W_NAMES = ("embed", None)


class Router(nnx.Module):
    """Linear D -> E gate; logits in float32 because top-k and the losses are precision-sensitive.

    The weight is replicated over the expert axis ("embed", None): every shard needs all E logits
    to pick its top-k, and the matrix is tiny.
    """

    def __init__(
        self,
        emb_dim: int,
        num_experts: int,
        *,
        init_std: float,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.w = make_param(rngs, normal(init_std), (emb_dim, num_experts), W_NAMES, param_dtype)

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        return project("td,de->te", x_TD.astype(jnp.float32), self.w[...], W_NAMES, jnp.float32)


def route(
    logits_TE: jax.Array, k: int, norm_topk_prob: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax over experts, then top-k (ties go to the lower expert id).

    Returns weights_TK float32 (renormalised to sum to 1 when norm_topk_prob), ids_TK int32 and
    the full probabilities probs_TE float32 (for the load-balancing loss).
    """
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, ids_TK.astype(jnp.int32), probs_TE


def load_balance_loss(probs_TE: jax.Array, ids_TK: jax.Array) -> jax.Array:
    """Switch-style E * sum_e f_e * P_e; 1.0 when routing is perfectly uniform.

    f_e: fraction of the T*K assignments sent to e (a count, carries no gradient);
    P_e: mean router probability of e over tokens (carries the gradient).
    """
    num_experts = probs_TE.shape[-1]
    f_E = expert_load(ids_TK, num_experts)
    p_E = jnp.mean(probs_TE, axis=0)
    return num_experts * jnp.sum(f_E * p_E)


def expert_load(ids_TK: jax.Array, num_experts: int) -> jax.Array:
    """f_E float32: the fraction of the T*K assignments routed to each expert (sums to 1).

    Counted before any capacity drop; a count, so it carries no gradient.
    """
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[ids_TK.reshape(-1)].add(1.0)
    return jax.lax.stop_gradient(counts_E / ids_TK.size)


def router_z_loss(logits_TE: jax.Array) -> jax.Array:
    """mean_t logsumexp(logits_t)^2: keeps router logits small (ST-MoE)."""
    lse_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.square(lse_T))
