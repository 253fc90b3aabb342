"""Group metadata for the Pallas TPU grouped matmul: which (group, row tile) each grid step visits.

Legend: M rows (sorted by group), G entries of group_sizes, L local groups served by the call
(global ids group_offset .. group_offset + L - 1), tm rows per tile, T grid steps along the
group axis (the static bound `max_visits`).

Rows of group g are [starts[g], ends[g]). Row tiles are walked in row order and a tile holding
rows of several local groups is visited once per group, on consecutive steps, so the kernel's
output block stays resident in VMEM across those visits. Over L groups the visits number at
most cdiv(M, tm) + L - 1: each group touches a run of tiles and neighbouring runs share at most
one tile. Steps past `num_visits` repeat the last real visit's (group, tile), so their block
indices do not change and Pallas issues no DMA for them; the kernels skip their compute.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupMetadata(NamedTuple):
    starts_L: jax.Array  # int32 [L] first row of each local group (clipped to M)
    ends_L: jax.Array  # int32 [L] one past its last row (clipped to M, >= starts)
    group_ids_T: jax.Array  # int32 [T] local group index visited at step t
    tile_ids_T: jax.Array  # int32 [T] row tile visited at step t
    num_visits: jax.Array  # int32 [1] real visits; steps t >= num_visits are no-ops


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_visits(m: int, tm: int, num_local: int) -> int:
    """Static grid extent T along the group axis."""
    return cdiv(m, tm) + num_local - 1


def make_group_metadata(
    group_sizes_G: jax.Array,
    group_offset: jax.Array,
    *,
    num_local: int,
    m: int,
    tm: int,
    visit_empty: bool,
) -> GroupMetadata:
    """Visit schedule for the local window of groups.

    visit_empty: give every empty local group one visit (of a tile it would start in), so a
    kernel that writes one output block per group (tgmm) writes zeros for it. The bound T
    still holds: an empty group adds one visit but shares no tile boundary.
    Local ids past the end of group_sizes count as empty groups.
    """
    g = group_sizes_G.shape[0]
    sizes_G = group_sizes_G.astype(jnp.int32)
    cum_G = jnp.cumsum(sizes_G)
    # Clipping to M keeps a malformed sum(group_sizes) > M from steering DMAs out of bounds.
    starts_G = jnp.minimum(cum_G - sizes_G, m)
    ends_G = jnp.minimum(cum_G, m)

    idx_L = jnp.asarray(group_offset, jnp.int32) + jnp.arange(num_local, dtype=jnp.int32)
    in_range_L = idx_L < g
    safe_L = jnp.minimum(idx_L, g - 1)
    starts_L = jnp.where(in_range_L, starts_G[safe_L], m)
    ends_L = jnp.maximum(jnp.where(in_range_L, ends_G[safe_L], m), starts_L)
    nonempty_L = ends_L > starts_L

    tiles_m = cdiv(m, tm)
    first_tile_L = jnp.minimum(starts_L // tm, tiles_m - 1)
    last_tile_L = (ends_L - 1) // tm
    visits_L = jnp.where(
        nonempty_L, last_tile_L - first_tile_L + 1, jnp.int32(1 if visit_empty else 0)
    )
    cum_visits_L = jnp.cumsum(visits_L)
    num_visits = cum_visits_L[-1]

    t_T = jnp.arange(max_visits(m, tm, num_local), dtype=jnp.int32)
    t_T = jnp.minimum(t_T, jnp.maximum(num_visits - 1, 0))
    # Visit t belongs to the first group whose cumulative visit count exceeds t; empty groups
    # (zero visits) are skipped because their count equals their predecessor's.
    gid_T = jnp.searchsorted(cum_visits_L, t_T, side="right").astype(jnp.int32)
    gid_T = jnp.minimum(gid_T, num_local - 1)
    first_visit_T = cum_visits_L[gid_T] - visits_L[gid_T]
    tile_T = first_tile_L[gid_T] + t_T - first_visit_T
    return GroupMetadata(
        starts_L=starts_L,
        ends_L=ends_L,
        group_ids_T=gid_T,
        tile_ids_T=tile_T.astype(jnp.int32),
        num_visits=num_visits.reshape(1).astype(jnp.int32),
    )
