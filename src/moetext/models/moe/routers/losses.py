"""Auxiliary losses and statistics that routers share, over the non-padding tokens only.

Legend: B batch, S sequence, T tokens (B*S flattened), E experts, K experts per token, G the
segment slots of a row (S + 1: segment ids 0..S, 0 = padding).

    valid_T = token_mask(segment_ids_BS, t)          # 1.0 for real tokens, 0.0 for padding
    counts_E = expert_counts(ids_TK, valid_T, e)     # non-padding assignments per expert
    lb = balance_loss(scope, probs_TE, ids_TK, valid_T, segment_ids_BS, prior_counts_E)
    z = router_z_loss(logits_TE, valid_T)

Every balance loss is 1.0 when routing is perfectly uniform (E * sum_e f_e * P_e with f the
load and P the mean affinity, both normalised to sum to 1; DeepSeek-V3's sequence-wise form
E/(K*T_s) * count_e is the same quantity per document). Loads are counts: they carry no gradient;
P carries it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
SCOPES = ("micro_batch", "sequence", "global_batch")


def token_mask(segment_ids_BS: jax.Array | None, t: int) -> jax.Array:
    """valid_T float32: 1.0 where the token is a document's (segment id > 0), 0.0 for padding;
    all ones without segment ids."""
    if segment_ids_BS is None:
        return jnp.ones((t,), F32)
    return (segment_ids_BS.reshape(-1) > 0).astype(F32)


def expert_counts(ids_TK: jax.Array, valid_T: jax.Array, num_experts: int) -> jax.Array:
    """counts_E float32: how many of the non-padding tokens' T*K assignments went to each expert
    (before any capacity drop; no gradient)."""
    k = ids_TK.shape[1]
    w_M = jnp.repeat(valid_T, k)  # row t*K + j of ids_TK.reshape(-1) is token t's
    counts_E = jnp.zeros((num_experts,), F32).at[ids_TK.reshape(-1)].add(w_M)
    return jax.lax.stop_gradient(counts_E)


def load_fraction(counts_E: jax.Array) -> jax.Array:
    """f_E: counts as fractions of all assignments (sums to 1; zeros when there are none)."""
    return counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)


def mean_affinity(probs_TE: jax.Array, valid_T: jax.Array) -> jax.Array:
    """P_E: the mean over non-padding tokens of each expert's normalised affinity."""
    total = jnp.sum(probs_TE * valid_T[:, None], axis=0)
    return total / jnp.maximum(jnp.sum(valid_T), 1.0)


def load_balance_loss(
    probs_TE: jax.Array,
    ids_TK: jax.Array,
    valid_T: jax.Array | None = None,
    prior_counts_E: jax.Array | None = None,
) -> jax.Array:
    """Switch-style E * sum_e f_e * P_e over the non-padding tokens (valid_T; None: all).

    prior_counts_E (global_batch scope): assignment counts of the step's earlier micro-batches,
    added to this one's before f is normalised (the Megatron / Qwen global-batch buffer)."""
    t, e = probs_TE.shape
    valid_T = jnp.ones((t,), F32) if valid_T is None else valid_T
    counts_E = expert_counts(ids_TK, valid_T, e)
    if prior_counts_E is not None:
        counts_E = counts_E + jax.lax.stop_gradient(prior_counts_E)
    return e * jnp.sum(load_fraction(counts_E) * mean_affinity(probs_TE, valid_T))


def sequence_balance_loss(
    probs_TE: jax.Array, ids_TK: jax.Array, segment_ids_BS: jax.Array
) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (its eqs. 17-20), a sequence being
    one document (segment) of a packed row: per document s with T_s tokens,
    f_e = E / (K * T_s) * count_e and P_e = mean over its tokens of the affinity, loss_s =
    sum_e f_e * P_e; the result is the mean over the batch's documents (padding excluded)."""
    (b, s), (_, e), k = segment_ids_BS.shape, probs_TE.shape, ids_TK.shape[1]
    onehot_TE = jnp.sum(jax.nn.one_hot(ids_TK, e, dtype=F32), axis=1)

    def segment_sums(x_SX: jax.Array, seg_S: jax.Array) -> jax.Array:
        return jax.ops.segment_sum(x_SX, seg_S, num_segments=s + 1)

    per_row = jax.vmap(segment_sums)
    counts_BGE = jax.lax.stop_gradient(per_row(onehot_TE.reshape(b, s, e), segment_ids_BS))
    probs_BGE = per_row(probs_TE.reshape(b, s, e), segment_ids_BS)
    tokens_BG = per_row(jnp.ones((b, s), F32), segment_ids_BS)[:, 1:]  # slot 0 is padding
    denom_BG1 = jnp.maximum(tokens_BG, 1.0)[..., None]
    f_BGE = e * counts_BGE[:, 1:] / (k * denom_BG1)
    p_BGE = probs_BGE[:, 1:] / denom_BG1
    present_BG = (tokens_BG > 0).astype(F32)
    loss_BG = jnp.sum(f_BGE * p_BGE, axis=-1)
    return jnp.sum(loss_BG * present_BG) / jnp.maximum(jnp.sum(present_BG), 1.0)


def balance_loss(
    scope: str,
    probs_TE: jax.Array,
    ids_TK: jax.Array,
    valid_T: jax.Array,
    segment_ids_BS: jax.Array | None,
    prior_counts_E: jax.Array | None = None,
) -> jax.Array:
    """The balance loss of `scope` (moe.aux_loss_scope): micro_batch, sequence (documents of
    segment_ids_BS; without them all T tokens are one) or global_batch (with prior_counts_E)."""
    if scope == "micro_batch":
        return load_balance_loss(probs_TE, ids_TK, valid_T)
    if scope == "global_batch":
        return load_balance_loss(probs_TE, ids_TK, valid_T, prior_counts_E)
    if scope == "sequence":
        if segment_ids_BS is None:  # decoding: all tokens one document (the loss goes unused)
            segment_ids_BS = jnp.ones((1, probs_TE.shape[0]), jnp.int32)
        return sequence_balance_loss(probs_TE, ids_TK, segment_ids_BS)
    raise ValueError(f"unknown moe.aux_loss_scope {scope!r}; valid: {', '.join(SCOPES)}")


def expert_load(ids_TK: jax.Array, num_experts: int) -> jax.Array:
    """f_E float32: the fraction of all T*K assignments routed to each expert (sums to 1)."""
    t = ids_TK.shape[0]
    return load_fraction(expert_counts(ids_TK, jnp.ones((t,), F32), num_experts))


def router_z_loss(logits_TE: jax.Array, valid_T: jax.Array | None = None) -> jax.Array:
    """mean over non-padding tokens of logsumexp(logits_t)^2: keeps router logits small
    (ST-MoE)."""
    lse_T = jax.nn.logsumexp(logits_TE.astype(F32), axis=-1)
    if valid_T is None:
        return jnp.mean(jnp.square(lse_T))
    return jnp.sum(jnp.square(lse_T) * valid_T) / jnp.maximum(jnp.sum(valid_T), 1.0)
