"""The expert-parallel exchange of `ep.dropless`: rows to the shard that owns their expert and
back, under a receive bound.

Legend as ep.py's: m = t*K local assignment rows, P expert-parallel shards, L = E/P experts per
shard, R rows received by a shard, C rows per destination in the padded exchange.

Two exchanges, picked by the mesh's platform (not a flag):
  * "ragged" (TPU): `jax.lax.ragged_all_to_all` sends exactly the rows each shard needs; the
    receive buffer holds R rows, by default the worst case R = P*m (every row of every shard to
    this shard), so the local experts' grouped matmuls run over P*m rows.
  * "padded" (CPU and others; XLA:CPU has no ragged-all-to-all): each shard sends every other
    shard a fixed buffer of C = min(m, R) rows (the worst case for one destination), so both
    the send and the receive buffers are [P*C, D]: with C = m, P times the rows of the
    single-shard path, and P times the bytes on the wire.

The receive bound (`buffer_factor`, config `moe.ep_buffer_factor`): R = ceil(factor * m) rows,
rounded up to a multiple of 8 (at most P*m). Balanced routing sends every shard m rows, so
factor 1 fits it exactly and 1.25 leaves a quarter for imbalance. A shard takes its rows in
source order (shard 0's first), each source's rows by local expert; rows past R are dropped:
their sender sends them nowhere, they come back as zeros (no output, no gradient), as capacity
dispatch drops a full expert's overflow. Both exchanges apply the same bound from the same
all-gathered counts, so CPU and TPU drop the same rows. `dropless` reports the fraction of
assignments dropped. factor 0 (the default): R = P*m, nothing is ever dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moetext.models.moe import dispatch as dsp

# The ragged collective, looked up at call time so a test can substitute an emulation on CPU.
ragged_all_to_all: Callable[..., jax.Array] = jax.lax.ragged_all_to_all


def exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def recv_rows(m: int, p: int, buffer_factor: float) -> int:
    """R, the rows of a shard's receive buffer for m local rows over P shards: the worst case
    P*m for factor 0, else ceil(factor * m) rounded up to a multiple of 8 (a sublane tile), at
    most P*m."""
    if buffer_factor == 0:
        return p * m
    return min(p * m, -(-math.ceil(buffer_factor * m) // 8) * 8)


def bound_drops(
    ids_TK: np.ndarray, num_experts: int, expert_shards: int, token_shards: int, factor: float
) -> tuple[int, int]:
    """(assignments dropped, assignments) for global expert ids [T, K] dispatched under a
    receive bound of `factor` (`moe.ep_buffer_factor`; 0: none), offline: T split into
    `token_shards` contiguous shards, each run of `expert_shards` consecutive token shards one EP
    group (the expert axis innermost, as fsdp_ep lays it out), each group's per-expert counts
    bounded by `Counts`, as the exchange bounds them (a receiver's R rows taken source by
    source). For routing traces (`train.routing_trace`, scripts/ep_bound.py)."""
    t, k = ids_TK.shape
    p = expert_shards
    if num_experts % p or token_shards % p or t % token_shards:
        raise ValueError(
            f"bound_drops: {num_experts} experts, {token_shards} token shards and {t} tokens "
            f"must all split over {p} expert shards (token shards over the tokens)"
        )
    m, n_local = t // token_shards * k, num_experts // p
    # sizes_GPE[g, i, e]: rows source i of EP group g sends to expert e, as `dropless` gathers them.
    ids_GPm = ids_TK.reshape(token_shards // p, p, m)
    sizes_GPE = np.zeros((*ids_GPm.shape[:2], num_experts), np.int32)
    groups, sources = np.indices(ids_GPm.shape[:2])
    np.add.at(sizes_GPE, (groups[..., None], sources[..., None], ids_GPm), 1)
    r = recv_rows(m, p, factor)
    dropped = jax.vmap(lambda s_PE: Counts(s_PE, p, n_local, r).dropped())(sizes_GPE)
    return int(jnp.sum(dropped)), t * k


class Counts:
    """Rows per (source, destination) shard and per (source, expert), all as sent (s_PP,
    sizes_PE) and as kept under a receive bound of R rows (kept_PP, kept_PE): receiver j takes
    source i's rows after those of sources < i, each source's by local expert, up to R."""

    def __init__(self, sizes_PE: jax.Array, p: int, n_local: int, r: int) -> None:
        self.r = r
        sizes_PPL = sizes_PE.reshape(p, p, n_local).astype(jnp.int32)
        self.s_PP = jnp.sum(sizes_PPL, axis=2)  # s_PP[i, j]: rows shard i sends to shard j
        # Where source i's rows start in receiver j, and how many of them fit below R.
        self.kept_PP = jnp.clip(r - exclusive_cumsum(self.s_PP, 0), 0, self.s_PP)
        kept_PPL = jnp.clip(self.kept_PP[..., None] - exclusive_cumsum(sizes_PPL, 2), 0, sizes_PPL)
        self.kept_PE = kept_PPL.reshape(p, p * n_local)
        self.n_local = n_local

    def dropped(self, me: jax.Array | None = None) -> jax.Array:
        """Rows the bound drops: at receiver `me`, or (None) in the whole group."""
        dropped_PP = self.s_PP - self.kept_PP
        return jnp.sum(dropped_PP if me is None else dropped_PP[:, me])

    def send_start(self, me: jax.Array) -> jax.Array:
        """[P]: where source `me`'s rows for each destination start in its sorted rows."""
        return exclusive_cumsum(self.s_PP[me], 0)

    def mine(self, me: jax.Array) -> jax.Array:
        """[P, L]: rows receiver `me` keeps from each source, per local expert."""
        return jax.lax.dynamic_slice_in_dim(self.kept_PE, me * self.n_local, self.n_local, axis=1)


def count_le(ends: jax.Array, rows: jax.Array) -> jax.Array:
    """For each row, how many of the sorted segment `ends` are <= it: the index of the segment
    holding the row (empty segments skipped), len(ends) past the last."""
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


class PaddedExchange:
    """Fixed [P, C] row buffers per destination, C = min(m, R), and a plain all_to_all (any
    platform)."""

    def __init__(
        self,
        axes: tuple[str, ...],
        p: int,
        me: jax.Array,
        counts: Counts,
        m: int,
    ) -> None:
        self.axes, self.p, self.m, self.c = axes, p, m, min(m, counts.r)
        # Destination j's rows start at send_start_P[j] of the sorted rows; the first send_P[j]
        # of them are sent (all but what j's receive bound drops).
        self.send_start_P = counts.send_start(me)
        self.ends_P = self.send_start_P + counts.s_PP[me]
        self.send_P = counts.kept_PP[me]
        self.mine_PL = counts.mine(me)

    def forward(self, xs_mD: jax.Array) -> tuple[jax.Array, jax.Array]:
        slot_C = jnp.arange(self.c, dtype=jnp.int32)
        src_PC = self.send_start_P[:, None] + slot_C[None, :]
        valid_PC = slot_C[None, :] < self.send_P[:, None]
        buf_PCD = jnp.where(
            valid_PC[..., None], dsp.rows(xs_mD, jnp.minimum(src_PC, self.m - 1)), 0
        )
        send_RD = buf_PCD.reshape(self.p * self.c, -1)
        recv = jax.lax.all_to_all(send_RD, self.axes, 0, 0, tiled=True)  # type: ignore[no-untyped-call]  # jax: unannotated
        ends_PL = jnp.cumsum(self.mine_PL, axis=1)
        # Local expert of received slot (i, s): how many of source i's expert blocks end at or
        # before s; n_local for the padding past what i sent.
        local_PC = jax.vmap(lambda ends_L: count_le(ends_L, slot_C))(ends_PL)
        return recv, local_PC.reshape(-1)

    def backward(self, ys_RD: jax.Array) -> jax.Array:
        back = jax.lax.all_to_all(ys_RD, self.axes, 0, 0, tiled=True)  # type: ignore[no-untyped-call]  # jax: unannotated
        # Sorted row r went to destination dest(r) at slot r - send_start[dest(r)], unless the
        # destination's bound dropped it (slot >= send_P[dest]): then it comes back as zeros.
        r_m = jnp.arange(self.m, dtype=jnp.int32)
        dest_m = jnp.minimum(count_le(self.ends_P, r_m), self.p - 1)
        slot_m = r_m - self.send_start_P[dest_m]
        kept_m = slot_m < self.send_P[dest_m]
        rows_mD = dsp.rows(back, dest_m * self.c + jnp.where(kept_m, slot_m, 0))
        return jnp.where(kept_m[:, None], rows_mD, 0)


class RaggedExchange:
    """`ragged_all_to_all` with exact sizes into a receive buffer of R rows (TPU)."""

    def __init__(
        self,
        axes: tuple[str, ...],
        p: int,
        me: jax.Array,
        counts: Counts,
        m: int,
    ) -> None:
        self.axes, self.m, self.r = axes, m, counts.r
        kept_PP = counts.kept_PP
        # This shard sends destination j the first send_P[j] of the rows that start at
        # send_start_P[j] of its sorted rows, and receives recv_P[i] from source i.
        self.send_P, self.recv_P = kept_PP[me], kept_PP[:, me]
        self.send_start_P = counts.send_start(me)
        self.recv_start_P = exclusive_cumsum(self.recv_P, 0)
        # Where this shard's rows land in receiver j (after those of shards i < me), and where
        # receiver j's chunk started in source i's sorted rows (for the way back).
        self.out_offsets_P = exclusive_cumsum(kept_PP, 0)[me]
        self.back_offsets_P = exclusive_cumsum(counts.s_PP, 1)[:, me]
        self.mine_PL = counts.mine(me)

    def forward(self, xs_mD: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = jnp.zeros((self.r, xs_mD.shape[1]), xs_mD.dtype)
        recv = ragged_all_to_all(
            xs_mD,
            out,
            self.send_start_P,
            self.send_P,
            self.out_offsets_P,
            self.recv_P,
            axis_name=self.axes,
        )
        # Received rows are segments (source i, local expert l) in (i, l) order.
        n_local = self.mine_PL.shape[1]
        ends_Q = jnp.cumsum(self.mine_PL.reshape(-1))
        r_R = jnp.arange(self.r, dtype=jnp.int32)
        seg_R = count_le(ends_Q, r_R)
        local_R = jnp.where(seg_R < ends_Q.shape[0], seg_R % n_local, n_local)
        return recv, local_R

    def backward(self, ys_RD: jax.Array) -> jax.Array:
        # Rows a receiver dropped are not sent back: they stay zeros in `out`.
        out = jnp.zeros((self.m, ys_RD.shape[1]), ys_RD.dtype)
        return ragged_all_to_all(
            ys_RD,
            out,
            self.recv_start_P,
            self.recv_P,
            self.back_offsets_P,
            self.send_P,
            axis_name=self.axes,
        )


# ep.EPLayout.exchange -> the exchange that runs it (P > 1).
EXCHANGES: dict[str, type[PaddedExchange] | type[RaggedExchange]] = {
    "padded": PaddedExchange,
    "ragged": RaggedExchange,
}
