"""Auxiliary losses and statistics that routers share.

Legend: T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
