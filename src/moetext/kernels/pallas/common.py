"""What the Pallas TPU grouped matmuls share: tile arithmetic, interpret mode, the grouped layout.

Legend: M rows (sorted by group), K contraction, N outputs, G entries of group_sizes, L local
groups served by the call (global ids group_offset .. group_offset + L - 1), tm/tk/tn tiles, T
grid steps along the group axis (the static bound `max_visits`).

Visit schedule. Rows of group g are [starts[g], ends[g]). Row tiles are walked in row order and
a tile holding rows of several local groups is visited once per group, on consecutive steps, so
a kernel's output block stays resident in VMEM across those visits. Over L groups the visits
number at most cdiv(M, tm) + L - 1: each group touches a run of tiles and neighbouring runs share
at most one tile. Steps past `num_visits` repeat the last real visit's (group, tile), so their
block indices do not change and Pallas issues no DMA for them; the kernels skip their compute.

The schedule (`GroupMetadata`) reaches a kernel as its first NUM_META operands (scalar
prefetch, in field order). Two grids walk it, each with its step skeleton here, so a kernel
file holds its accumulate step (its math) and its pallas_call wiring:
  gmm  (j N tile, t visit, k K tile): a visit multiplies row tile `tile` by group `group`'s
       weights, accumulating K in f32, and stores only that group's rows (`gmm_step`);
  tgmm (i K tile, j N tile, t visit): a group's [tk, tn] block accumulates lhs.T @ rhs over
       the group's row tiles and is stored once, when the group changes (`tgmm_step`).
Index maps on either grid are written against the visited `Visit` (`on_gmm_grid`,
`on_tgmm_grid`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import ArrayLike, DTypeLike

from moetext.kernels.pallas import target

# interpret= of pl.pallas_call: False compiles with Mosaic, True runs the generic interpreter,
# a pltpu.InterpretParams the TPU-faithful one (uninitialised VMEM is NaN, DMAs modelled).
Interpret = bool | pltpu.InterpretParams
IndexMap = Callable[..., tuple[Any, ...]]
Ref = Any  # a Pallas kernel's view of one operand (VMEM or SMEM)
Dimensions = tuple[Literal["parallel", "arbitrary"], ...]  # dimension_semantics of a grid

# "parallel" axes may be split across a megacore's TensorCores; "arbitrary" ones run in order.
# gmm revisits a row tile's output block on consecutive visits and accumulates K in place;
# tgmm accumulates a group's output block over that group's consecutive visits.
GMM_DIMENSIONS: Dimensions = ("parallel", "arbitrary", "arbitrary")
TGMM_DIMENSIONS: Dimensions = ("parallel", "parallel", "arbitrary")


# --- tile arithmetic ---------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many b-long tiles cover a."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of b that is >= a."""
    return cdiv(a, b) * b


def pow2_ceil(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def resolve_interpret(interpret: Interpret | None) -> Interpret:
    """None: interpret unless jax's default backend is TPU or the kernel is traced for a TPU
    (`target.compiling_for`, an ahead-of-time compile); anything else as given."""
    if interpret is not None:
        return interpret
    return not target.tpu_code()


# --- the visit schedule ------------------------------------------------------------------------


class GroupMetadata(NamedTuple):
    starts_L: jax.Array  # int32 [L] first row of each local group (clipped to M)
    ends_L: jax.Array  # int32 [L] one past its last row (clipped to M, >= starts)
    group_ids_T: jax.Array  # int32 [T] local group index visited at step t
    tile_ids_T: jax.Array  # int32 [T] row tile visited at step t
    num_visits: jax.Array  # int32 [1] real visits; steps t >= num_visits are no-ops


NUM_META = len(GroupMetadata._fields)


def max_visits(m: int, tm: int, num_local: int) -> int:
    """Static grid extent T along the group axis."""
    return cdiv(m, tm) + num_local - 1


def make_group_metadata(
    group_sizes_G: jax.Array,
    group_offset: ArrayLike,
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


def split_refs(refs: Sequence[Ref]) -> tuple[GroupMetadata, tuple[Ref, ...]]:
    """A grouped kernel's positional refs: (the schedule, the array operands and scratch)."""
    return GroupMetadata(*refs[:NUM_META]), tuple(refs[NUM_META:])


# --- grids and block specs ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Visit:
    """Grid step t's schedule entry, read from the prefetched refs only where an index map
    uses it (each read is a scalar load per grid step)."""

    t: Any
    refs: GroupMetadata

    @property
    def group(self) -> Any:
        return self.refs.group_ids_T[self.t]

    @property
    def tile(self) -> Any:
        return self.refs.tile_ids_T[self.t]


def on_gmm_grid(block_index: Callable[[Any, Any, Visit], tuple[Any, ...]]) -> IndexMap:
    """The Pallas index map of block_index(j, k, visit) on the gmm grid (j, t, k)."""

    def index_map(j: Any, t: Any, k: Any, *refs: Any) -> tuple[Any, ...]:
        return block_index(j, k, Visit(t, GroupMetadata(*refs)))

    return index_map


def on_tgmm_grid(block_index: Callable[[Any, Any, Visit], tuple[Any, ...]]) -> IndexMap:
    """The Pallas index map of block_index(i, j, visit) on the tgmm grid (i, j, t)."""

    def index_map(i: Any, j: Any, t: Any, *refs: Any) -> tuple[Any, ...]:
        return block_index(i, j, Visit(t, GroupMetadata(*refs)))

    return index_map


def gmm_block_specs(
    tm: int, tk: int, tn: int, *, transpose_rhs: bool
) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """lhs (tm, tk) of the visited row tile; rhs (tk, tn), or (tn, tk) with transpose_rhs, of
    the visited group's [K, N] ([N, K]) weights; out (tm, tn) of the row tile."""
    if transpose_rhs:
        rhs = pl.BlockSpec((pl.squeezed, tn, tk), on_gmm_grid(lambda j, k, v: (v.group, j, k)))
    else:
        rhs = pl.BlockSpec((pl.squeezed, tk, tn), on_gmm_grid(lambda j, k, v: (v.group, k, j)))
    lhs = pl.BlockSpec((tm, tk), on_gmm_grid(lambda j, k, v: (v.tile, k)))
    return lhs, rhs, pl.BlockSpec((tm, tn), _gmm_out_map())


def _gmm_out_map() -> IndexMap:
    return on_gmm_grid(lambda j, k, v: (v.tile, j))


def tgmm_block_specs(tm: int, tk: int, tn: int) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """lhs (tm, tk) and rhs (tm, tn) of the visited row tile; out (tk, tn) of the visited
    group's [K, N] block."""
    return (
        pl.BlockSpec((tm, tk), on_tgmm_grid(lambda i, j, v: (v.tile, i))),
        pl.BlockSpec((tm, tn), on_tgmm_grid(lambda i, j, v: (v.tile, j))),
        pl.BlockSpec((pl.squeezed, tk, tn), on_tgmm_grid(lambda i, j, v: (v.group, i, j))),
    )


def grouped_grid_spec(
    grid: tuple[int, int, int],
    in_specs: Sequence[pl.BlockSpec],
    out_spec: pl.BlockSpec,
    acc_shape: tuple[int, int],
) -> pltpu.PrefetchScalarGridSpec:
    """The grid spec of a grouped kernel: GroupMetadata prefetched ahead of the array operands,
    and one f32 VMEM accumulator."""
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=NUM_META,
        grid=grid,
        in_specs=list(in_specs),
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
    )


def gmm_aliased_out(
    existing_MN: jax.Array | None,
    m: int,
    n: int,
    tiles: tuple[int, int, int],
    out_dtype: DTypeLike,
    interpret: Interpret,
) -> tuple[jax.Array, pl.BlockSpec, tuple[int, int]]:
    """The buffer a gmm output aliases: (init [M', N'], its BlockSpec, output shape M', N').

    Row tiles no visit touches keep init: zeros, or existing_out. Without existing_out the
    kernel never reads init, so on TPU it stays in HBM (no DMA). The interpreters give an
    aliased output the input's buffer as padded for the input's block, so there init gets the
    output's block, and the TPU interpreter, which then returns that padded buffer, gets whole
    blocks (the caller slices the output back to [:M, :N]).
    """
    tm, _, tn = tiles
    if existing_MN is None:
        init_MN = jnp.zeros((m, n), out_dtype)
    else:
        init_MN = existing_MN.astype(out_dtype)
    init_spec = pl.BlockSpec(memory_space=pl.ANY)
    if existing_MN is not None or interpret is not False:
        init_spec = pl.BlockSpec((tm, tn), _gmm_out_map())
    out_mn = (m, n)
    if isinstance(interpret, pltpu.InterpretParams):
        out_mn = (round_up(m, tm), round_up(n, tn))
        init_MN = jnp.pad(init_MN, ((0, out_mn[0] - m), (0, out_mn[1] - n)))
    return init_MN, init_spec, out_mn


# --- kernel steps ------------------------------------------------------------------------------


def rows_within(shape: tuple[int, ...], row0: Any, start: Any, end: Any) -> jax.Array:
    """Mask of a block's rows (axis 0, the first being row row0) that lie in [start, end)."""
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    mine: jax.Array = (rows >= start) & (rows < end)
    return mine


def zero_rows_outside(x: jax.Array, row0: Any, start: Any, end: Any) -> jax.Array:
    """x with the rows outside [start, end) zeroed (row0 as in `rows_within`)."""
    return jnp.where(rows_within(x.shape, row0, start, end), x, jnp.zeros((), x.dtype))


def gmm_step(
    meta: GroupMetadata,
    out_ref: Ref,
    acc_ref: Ref,
    *,
    tm: int,
    accumulate: Callable[[], None],
    base: Callable[[], jax.Array],
) -> None:
    """One gmm grid step (j, t, k): on a visit, zero the accumulator at k == 0, `accumulate()`
    into it, and at the last k store the visited group's rows into the row tile's output block.

    base(): what rows outside every local group hold (zeros, or the aliased existing_out).
    """
    t, ki = pl.program_id(1), pl.program_id(2)
    last_k = pl.num_programs(2) - 1
    num_visits = meta.num_visits[0]

    @pl.when(t < num_visits)
    def _visit() -> None:
        @pl.when(ki == 0)
        def _() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        accumulate()

        @pl.when(ki == last_k)
        def _store() -> None:
            g, tile = meta.group_ids_T[t], meta.tile_ids_T[t]
            mine = rows_within(out_ref.shape, tile * tm, meta.starts_L[g], meta.ends_L[g])
            acc = acc_ref[...].astype(out_ref.dtype)
            # The first visit of a tile sees an uninitialised output buffer; later visits
            # (other groups sharing the tile) keep what earlier ones stored.
            first = (t == 0) | (meta.tile_ids_T[jnp.maximum(t - 1, 0)] != tile)

            @pl.when(first)
            def _() -> None:
                out_ref[...] = jnp.where(mine, acc, base())

            @pl.when(jnp.logical_not(first))
            def _() -> None:
                out_ref[...] = jnp.where(mine, acc, out_ref[...])

    # No local rows at all: the grid still maps one output block, which must not be garbage.
    @pl.when((num_visits == 0) & (t == 0) & (ki == last_k))
    def _empty() -> None:
        out_ref[...] = base()


def tgmm_step(
    meta: GroupMetadata,
    out_ref: Ref,
    acc_ref: Ref,
    *,
    accumulate: Callable[[Any, Any, Any], None],
) -> None:
    """One tgmm grid step (i, j, t): on a visit, zero the accumulator on the group's first
    visit, `accumulate(tile, start, end)` the visited row tile into it (rows of the group are
    [start, end)), and store it on the group's last visit. Every local group has a visit
    (visit_empty), so empty groups store zeros."""
    t, last_t = pl.program_id(2), pl.num_programs(2) - 1
    num_visits = meta.num_visits[0]
    gids_T = meta.group_ids_T
    g, tile = gids_T[t], meta.tile_ids_T[t]
    first = (t == 0) | (gids_T[jnp.maximum(t - 1, 0)] != g)
    last = (t == num_visits - 1) | (gids_T[jnp.minimum(t + 1, last_t)] != g)

    @pl.when(t < num_visits)
    def _visit() -> None:
        @pl.when(first)
        def _() -> None:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        accumulate(tile, meta.starts_L[g], meta.ends_L[g])

        @pl.when(last)
        def _() -> None:
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)
