"""Pallas Mosaic TPU grouped matmul and its transposed twin (megablox-style): gmm, tgmm.

Legend: M rows (sorted by group), K contraction, N outputs, G entries of group_sizes, L local
groups (G_local), T grid steps along the group axis (see common.py), tm/tk/tn tiles.

gmm grid (N tiles, T, K tiles): step (j, t, k) multiplies row tile tile_ids[t] by the rhs of
group group_ids[t], accumulating K in an f32 VMEM scratch; on the last K step it stores only
the rows of that group. Visits to one row tile are consecutive, so its output block stays in
VMEM between them (read-modify-write) and is written back to HBM once. The output aliases an
initial buffer (zeros, or existing_out) so row tiles no local group touches keep it, unless the
caller says every row belongs to a local group (`rows_covered`): then every row tile is visited,
and the kernel has no initial buffer at all (no zeros written to HBM before it runs).

tgmm grid (K tiles, N tiles, T): step (i, j, t) accumulates lhs_tile.T @ rhs_tile over the row
tiles of one group, masking rows of other groups, and stores the [tk, tn] block when the group
changes. Every local group gets at least one visit, so empty groups come out zero.

The schedule, block specs and the visit/store skeleton of both grids are in common.py; this
file holds the two accumulate steps and their pallas_call wiring. The `pallas_tpu` gmm backend
(kernels/gmm/pallas_tpu.py) calls these two functions.

Off TPU the kernels run in Pallas interpret mode; `interpret=pltpu.InterpretParams()` selects
the TPU-faithful interpreter (uninitialised VMEM is NaN, DMAs and revisits modelled).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike, DTypeLike

from moetext.kernels.pallas import tiling as tiling_lib
from moetext.kernels.pallas.common import (
    GMM_DIMENSIONS,
    NUM_META,
    TGMM_DIMENSIONS,
    Interpret,
    Ref,
    cdiv,
    gmm_aliased_out,
    gmm_block_specs,
    gmm_step,
    grouped_grid_spec,
    make_group_metadata,
    max_visits,
    resolve_interpret,
    split_refs,
    tgmm_block_specs,
    tgmm_step,
    zero_rows_outside,
)
from moetext.kernels.pallas.tiling import TilingArg
from moetext.kernels.typed_jax import ShapeDtypeStruct

# --- gmm ---------------------------------------------------------------------------------------


def gmm(
    lhs_MK: jax.Array,
    rhs: jax.Array,
    group_sizes_G: jax.Array,
    *,
    preferred_element_type: DTypeLike,
    transpose_rhs: bool = False,
    group_offset: ArrayLike = 0,
    tiling: TilingArg = None,
    existing_out: jax.Array | None = None,
    rows_covered: bool = False,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """[M, N]: rows of local group g = lhs rows @ rhs[g - group_offset]; lhs [M, K], rhs
    [L, K, N] ([L, N, K] when transpose_rhs). Rows outside the local groups are zero, or keep
    `existing_out` [M, N] (an aliased, in-place initial buffer). rows_covered: the caller
    guarantees every row belongs to a local group (sum of the local group sizes == M), so no
    initial buffer is needed (rows outside the groups would otherwise be undefined). interpret
    and chip as in `PallasTpuBackend` (None: interpret off TPU; the local chip, else
    tiling.FALLBACK_CHIP)."""
    (m, k), num_local = lhs_MK.shape, rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    chip, interpret = tiling_lib.resolve_chip(chip), resolve_interpret(interpret)
    g = group_sizes_G.shape[0]
    tiles = tiling_lib.resolve_tiling(tiling, m, k, n, lhs_MK.dtype, chip, num_groups=g)
    out_dtype, existing_MN = jnp.dtype(preferred_element_type), existing_out
    tm, tk, tn = tiles
    tiling_lib.check_gmm_blocks("gmm", tiles, lhs_MK, rhs, out_dtype, transpose_rhs=transpose_rhs)
    meta = make_group_metadata(
        group_sizes_G, group_offset, num_local=num_local, m=m, tm=tm, visit_empty=False
    )
    t_max = max_visits(m, tm, num_local)
    lhs_spec, rhs_spec, out_spec = gmm_block_specs(tm, tk, tn, transpose_rhs=transpose_rhs)
    if rows_covered and existing_MN is not None:
        raise ValueError(
            "gmm: rows_covered=True and existing_out: a covered output keeps no row of "
            "existing_out; pass one or the other"
        )
    has_init = existing_MN is not None
    # The initial buffer only where some row tile may go unvisited (see the module docstring).
    operands, specs, aliases, out_mn = [lhs_MK, rhs], [lhs_spec, rhs_spec], {}, (m, n)
    if not rows_covered:
        init_MN, init_spec, out_mn = gmm_aliased_out(existing_MN, m, n, tiles, out_dtype, interpret)
        operands, specs, aliases = operands + [init_MN], specs + [init_spec], {NUM_META + 2: 0}
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        # Each visit streams its lhs tile per N tile and its group's K x N weights.
        bytes_accessed=t_max * (tm * k * lhs_MK.dtype.itemsize * cdiv(n, tn))
        + t_max * k * n * rhs.dtype.itemsize
        + m * n * out_dtype.itemsize * (2 if has_init else 1),
    )
    needed = tiling_lib.vmem_bytes(
        [(tm, tk, lhs_MK.dtype), (tk, tn, rhs.dtype)] + ([(tm, tn, out_dtype)] if has_init else []),
        (tm, tn, out_dtype),
        (tm, tn),
    )
    kernel = functools.partial(
        _gmm_kernel,
        k=k,
        tm=tm,
        tk=tk,
        transpose_rhs=transpose_rhs,
        has_init=has_init,
        init_operand=not rows_covered,
    )
    out_MN: jax.Array = pl.pallas_call(
        kernel,
        out_shape=ShapeDtypeStruct(out_mn, out_dtype),
        grid_spec=grouped_grid_spec((cdiv(n, tn), t_max, cdiv(k, tk)), specs, out_spec, (tm, tn)),
        input_output_aliases=aliases,
        compiler_params=tiling_lib.compiler_params("gmm", GMM_DIMENSIONS, tiles, needed, chip),
        interpret=interpret,
        cost_estimate=cost,
        name="moetext_gmm",
    )(*meta, *operands)
    return out_MN[:m, :n]


def _gmm_kernel(
    *refs: Ref,
    k: int,
    tm: int,
    tk: int,
    transpose_rhs: bool,
    has_init: bool,
    init_operand: bool,
) -> None:
    """acc[tm, tn] += lhs[tm, tk] @ rhs[tk, tn] (rhs[tn, tk].T with transpose_rhs) over K."""
    meta, arrays = split_refs(refs)
    if init_operand:
        lhs_ref, rhs_ref, init_ref, out_ref, acc_ref = arrays
    else:
        (lhs_ref, rhs_ref, out_ref, acc_ref), init_ref = arrays, None
    ki, last_k = pl.program_id(2), pl.num_programs(2) - 1
    contract = (1,) if transpose_rhs else (0,)

    def accumulate(mask_tail: bool) -> None:
        lhs, rhs = lhs_ref[...], rhs_ref[...]
        if mask_tail:
            lhs = _mask_cols(lhs, 1, ki * tk, k)
            rhs = _mask_cols(rhs, 1 if transpose_rhs else 0, ki * tk, k)
        acc_ref[...] += jax.lax.dot_general(
            lhs, rhs, (((1,), contract), ((), ())), preferred_element_type=jnp.float32
        )

    def step() -> None:
        if k % tk:  # only the last K block runs past K; the masks cost VPU time elsewhere
            pl.when(ki == last_k)(lambda: accumulate(True))
            pl.when(ki != last_k)(lambda: accumulate(False))
        else:
            accumulate(False)

    def base() -> jax.Array:  # what rows outside the visited group hold before any visit
        if has_init and init_ref is not None:
            init: jax.Array = init_ref[...]
            return init
        return jnp.zeros(out_ref.shape, out_ref.dtype)

    gmm_step(meta, out_ref, acc_ref, tm=tm, accumulate=step, base=base)


def _mask_cols(x: jax.Array, axis: int, start: jax.Array, limit: int) -> jax.Array:
    """Zeroes the entries of x at positions >= limit along `axis` (K tail past the array)."""
    pos = start + jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(pos < limit, x, jnp.zeros((), x.dtype))


# --- tgmm --------------------------------------------------------------------------------------


def tgmm(
    lhs_MK: jax.Array,
    rhs_MN: jax.Array,
    group_sizes_G: jax.Array,
    *,
    num_groups: int,
    preferred_element_type: DTypeLike,
    group_offset: ArrayLike = 0,
    tiling: TilingArg = None,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """[L, K, N]: out[i] = lhs[rows of g].T @ rhs[rows of g], g = group_offset + i; lhs [M, K],
    rhs [M, N]; zero for empty groups."""
    (m, k), n = lhs_MK.shape, rhs_MN.shape[1]
    chip, interpret = tiling_lib.resolve_chip(chip), resolve_interpret(interpret)
    g = group_sizes_G.shape[0]
    tiles = tiling_lib.resolve_tiling(tiling, m, k, n, lhs_MK.dtype, chip, num_groups=g)
    out_dtype, num_groups = jnp.dtype(preferred_element_type), int(num_groups)
    tm, tk, tn = tiles
    tiling_lib.check_tgmm_blocks("tgmm", tiles, lhs_MK, rhs_MN, out_dtype)
    meta = make_group_metadata(
        group_sizes_G, group_offset, num_local=num_groups, m=m, tm=tm, visit_empty=True
    )
    t_max = max_visits(m, tm, num_groups)
    lhs_spec, rhs_spec, out_spec = tgmm_block_specs(tm, tk, tn)
    tiles_k, tiles_n = cdiv(k, tk), cdiv(n, tn)
    cost = pl.CostEstimate(
        flops=2 * m * k * n,
        transcendentals=0,
        bytes_accessed=t_max
        * tm
        * (k * lhs_MK.dtype.itemsize * tiles_n + n * rhs_MN.dtype.itemsize * tiles_k)
        + num_groups * k * n * out_dtype.itemsize,
    )
    needed = tiling_lib.vmem_bytes(
        [(tm, tk, lhs_MK.dtype), (tm, tn, rhs_MN.dtype)], (tk, tn, out_dtype), (tk, tn)
    )
    out_LKN: jax.Array = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=grouped_grid_spec(
            (tiles_k, tiles_n, t_max), [lhs_spec, rhs_spec], out_spec, (tk, tn)
        ),
        compiler_params=tiling_lib.compiler_params("tgmm", TGMM_DIMENSIONS, tiles, needed, chip),
        interpret=interpret,
        cost_estimate=cost,
        name="moetext_tgmm",
    )(*meta, lhs_MK, rhs_MN)
    return out_LKN


def _tgmm_kernel(*refs: Ref, tm: int) -> None:
    """acc[tk, tn] += lhs[tm, tk].T @ rhs[tm, tn] over the rows of the visited group."""
    meta, (lhs_ref, rhs_ref, out_ref, acc_ref) = split_refs(refs)

    def accumulate(tile: jax.Array, start: jax.Array, end: jax.Array) -> None:
        def product(mask_rows: bool) -> None:
            lhs, rhs = lhs_ref[...], rhs_ref[...]
            if mask_rows:
                # Masks both operands: rows past M hold garbage (maybe NaN), and NaN * 0 is NaN.
                lhs = zero_rows_outside(lhs, tile * tm, start, end)
                rhs = zero_rows_outside(rhs, tile * tm, start, end)
            acc_ref[...] += jax.lax.dot_general(
                lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )

        # Most tiles lie inside their group (ends <= M, so no rows past M either): skip the
        # masks there, they cost VPU time on every [tm, tk] and [tm, tn] element.
        inside = (tile * tm >= start) & (tile * tm + tm <= end)
        pl.when(inside)(lambda: product(False))
        pl.when(jnp.logical_not(inside))(lambda: product(True))

    tgmm_step(meta, out_ref, acc_ref, accumulate=accumulate)
