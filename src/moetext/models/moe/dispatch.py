"""Token <-> expert-row movement for the two dispatch modes, as small pure functions.

Legend: T tokens, K experts per token, M = T*K assignment rows, D emb_dim, E experts,
C capacity slots per expert.

dropless: `permute` sorts the M assignments by expert (stable, so token order is kept inside a
group) and `unpermute` undoes it; the expert compute is a grouped matmul over group_sizes.
capacity: `capacity_slots` gives each assignment a slot in its expert's fixed buffer; slots
past C are dropped; `to_buffers` / `from_buffers` move rows in and out of [E, C, D].
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def rows(x: jax.Array, idx: jax.Array, unique: bool = False) -> jax.Array:
    """x[idx] along axis 0 for indices in bounds by construction (a sort's order, its inverse);
    unique: no index repeats (a permutation).

    Not jnp.take: its default mode returns a fill value for out-of-bound indices by masking
    every gathered row with a select, a second pass over the rows in HBM on TPU (2 x 12.9 GB
    per Qwen3-30B-A3B step on v5p-64, docs/performance.md). promise_in_bounds gathers alone."""
    out: jax.Array = jnp.asarray(x).at[idx].get(mode="promise_in_bounds", unique_indices=unique)
    return out


def permute(
    x_TD: jax.Array, ids_TK: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rows of x repeated per assignment and sorted by expert.

    Returns xs_MD (row i is token order_M[i] // K), group_sizes_E int32 and order_M, the flat
    assignment index (t * K + k) of each sorted row.
    """
    k = ids_TK.shape[1]
    flat_M = ids_TK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True).astype(jnp.int32)
    xs_MD = rows(x_TD, order_M // k)
    group_sizes_E = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    return xs_MD, group_sizes_E, order_M


def unpermute(ys_MD: jax.Array, order_M: jax.Array, k: int) -> jax.Array:
    """Inverse of `permute`'s sort: [M, D] sorted rows -> y_TKD in (token, choice) order."""
    m, d = ys_MD.shape
    # An integer scatter builds the inverse permutation; the data then moves by gather, whose
    # gradient is a cheap scatter-add.
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(m, dtype=order_M.dtype))
    return rows(ys_MD, inverse_M, unique=True).reshape(m // k, k, d)


def routing_weights_sorted(weights_TK: jax.Array, order_M: jax.Array) -> jax.Array:
    """[M] float32: each sorted row's routing weight (weights_TK flattened, in `permute`'s
    order), to scale the row before the down projection."""
    return rows(weights_TK.reshape(-1), order_M, unique=True).astype(jnp.float32)


def unpermute_sum(ys_MD: jax.Array, order_M: jax.Array, k: int, dtype: DTypeLike) -> jax.Array:
    """y_TD = sum_k unpermute(ys_MD, order_M, K)[:, k], accumulated in float32, cast to `dtype`:
    the combine of rows already scaled by their routing weights (the MoE layer scales them
    before the down projection, kernels/activations.swiglu's `scale`).

    Its backward is one gather of dout per sorted row (dys = dout[token of the row]) and keeps
    only order_M: nothing of ys, so under rematerialisation the recomputed forward needs no
    down projection output (Qwen3-235B-A22B on v5p-256: one [M, F] x [F, D] gmm per layer less,
    docs/performance.md)."""
    if ys_MD.shape[0] % k:
        raise ValueError(f"unpermute_sum: {ys_MD.shape[0]} rows are not T x K for K = {k}")
    out: jax.Array = _unpermute_sum(k, jnp.dtype(dtype), ys_MD, order_M)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _unpermute_sum(k: int, dtype: jnp.dtype, ys_MD: jax.Array, order_M: jax.Array) -> jax.Array:
    y_TKD = unpermute(ys_MD, order_M, k)
    return jnp.sum(y_TKD.astype(jnp.float32), axis=1).astype(dtype)


def _unpermute_sum_fwd(
    k: int, dtype: jnp.dtype, ys_MD: jax.Array, order_M: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    # The zero-size marker carries ys's dtype to the backward without keeping ys.
    return _unpermute_sum(k, dtype, ys_MD, order_M), (order_M, jnp.zeros((0,), ys_MD.dtype))


def _unpermute_sum_bwd(
    k: int, dtype: jnp.dtype, res: tuple[jax.Array, jax.Array], dout_TD: jax.Array
) -> tuple[jax.Array, None]:
    order_M, like = res
    return rows(dout_TD, order_M // k).astype(like.dtype), None


_unpermute_sum.defvjp(_unpermute_sum_fwd, _unpermute_sum_bwd)


def combine(y_TKD: jax.Array, weights_TK: jax.Array, dtype: DTypeLike) -> jax.Array:
    """sum_k weights[t, k] * y[t, k] accumulated in float32, cast to `dtype`."""
    out_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK.astype(jnp.float32))
    return out_TD.astype(dtype)


def capacity(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert: ceil(factor * T * K / E), clamped to [1, T].

    An expert can receive at most T assignments (top-k picks distinct experts), so more slots
    would only hold zeros.
    """
    if factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {factor}")
    return max(1, min(num_tokens, math.ceil(factor * num_tokens * k / num_experts)))


def capacity_slots(ids_TK: jax.Array, num_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """Slot of each assignment inside its expert's buffer, and whether it fits (slot < cap).

    Priority: all first choices (k = 0) in token order, then all second choices, and so on, so
    overflow drops the lower-ranked choices first.
    """
    t, k = ids_TK.shape
    ids_M = ids_TK.T.reshape(-1)  # (k, t) order gives the priority
    onehot_ME = jax.nn.one_hot(ids_M, num_experts, dtype=jnp.int32)
    pos_M = jnp.take_along_axis(jnp.cumsum(onehot_ME, axis=0), ids_M[:, None], axis=1)[:, 0] - 1
    pos_TK = pos_M.reshape(k, t).T
    return pos_TK, pos_TK < cap


def to_buffers(
    x_TD: jax.Array, ids_TK: jax.Array, pos_TK: jax.Array, num_experts: int, cap: int
) -> jax.Array:
    """x_ECD with row t at [ids[t, k], pos[t, k]]; assignments with pos >= cap are dropped."""
    t, k = ids_TK.shape
    x_MD = jnp.repeat(x_TD, k, axis=0)
    buf_ECD = jnp.zeros((num_experts, cap, x_TD.shape[1]), x_TD.dtype)
    # Kept (expert, slot) pairs are unique, so add == set here; add's transpose is a plain
    # gather, where set's would need the uniqueness bookkeeping of a general scatter.
    return buf_ECD.at[ids_TK.reshape(-1), pos_TK.reshape(-1)].add(x_MD, mode="drop")


def from_buffers(y_ECD: jax.Array, ids_TK: jax.Array, pos_TK: jax.Array) -> jax.Array:
    """y_TKD read back from the buffers; dropped assignments read as zero."""
    t, k = ids_TK.shape
    y_MD = y_ECD.at[ids_TK.reshape(-1), pos_TK.reshape(-1)].get(mode="fill", fill_value=0)
    return y_MD.reshape(t, k, y_ECD.shape[-1])
