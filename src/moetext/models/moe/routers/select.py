"""Top-k expert selection, optionally limited to each token's best expert groups.

Legend: T tokens, E experts, K experts per token, G expert groups (n_group), N = E / G experts
per group.

    ids_TK = select_experts(choice_TE, k, n_group=1, topk_group=1, group_score="max")

Ties go to the lowest group and the lowest expert id (XLA's top_k is stable), as DeepSeek's
and transformers' torch.topk do on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP_SCORES = ("max", "top2_sum")


def group_mask(choice_TE: jax.Array, n_group: int, topk_group: int, group_score: str) -> jax.Array:
    """bool [T, E]: True for the experts of each token's topk_group best groups. A group's score
    is its highest choice value (max: DeepSeek-V2's group_limited_greedy) or the sum of its two
    highest (top2_sum: DeepSeek-V3)."""
    t, e = choice_TE.shape
    g_TGN = choice_TE.reshape(t, n_group, e // n_group)
    if group_score == "max":
        score_TG = jnp.max(g_TGN, axis=-1)
    elif group_score == "top2_sum":
        score_TG = jnp.sum(jax.lax.top_k(g_TGN, 2)[0], axis=-1)
    else:
        raise ValueError(f"unknown group_score {group_score!r}; valid: {', '.join(GROUP_SCORES)}")
    _, best_TX = jax.lax.top_k(score_TG, topk_group)
    keep_TG = jnp.any(best_TX[..., None] == jnp.arange(n_group), axis=1)
    return jnp.repeat(keep_TG, e // n_group, axis=1)


def select_experts(
    choice_TE: jax.Array,
    k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "max",
) -> jax.Array:
    """ids_TK int32: each token's K highest choice values, among its topk_group best groups of
    n_group when n_group > 1 (the other groups' experts masked to -inf, as DeepSeek's own code
    does; transformers fills 0.0, the same whenever the eligible values are positive)."""
    if n_group > 1:
        keep_TE = group_mask(choice_TE, n_group, topk_group, group_score)
        choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
    _, ids_TK = jax.lax.top_k(choice_TE, k)
    return ids_TK.astype(jnp.int32)
