"""Pallas Mosaic TPU grouped matmul (megablox-style): the `pallas_tpu` gmm backend.

Legend: M rows (sorted by group), K contraction, N outputs, G entries of group_sizes, L local
groups (G_local), T grid steps along the group axis (see pallas_metadata), tm/tk/tn tiles.

gmm grid (N tiles, T, K tiles): step (j, t, k) multiplies row tile tile_ids[t] by the rhs of
group group_ids[t], accumulating K in an f32 VMEM scratch; on the last K step it stores only
the rows of that group. Visits to one row tile are consecutive, so its output block stays in
VMEM between them (read-modify-write) and is written back to HBM once. The output aliases an
initial buffer (zeros, or existing_out) so row tiles no local group touches keep it.

tgmm grid (K tiles, N tiles, T): step (i, j, t) accumulates lhs_tile.T @ rhs_tile over the row
tiles of one group, masking rows of other groups, and stores the [tk, tn] block when the group
changes. Every local group gets at least one visit, so empty groups come out zero.

Off TPU the kernels run in Pallas interpret mode; `interpret=pltpu.InterpretParams()` selects
the TPU-faithful interpreter (uninitialised VMEM is NaN, DMAs and revisits modelled).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moetext.kernels.gmm import tiling as tiling_lib
from moetext.kernels.gmm.backend import register
from moetext.kernels.gmm.pallas_metadata import cdiv, make_group_metadata, max_visits

_NUM_META = 5  # scalar-prefetch operands: starts_L, ends_L, group_ids_T, tile_ids_T, num_visits


@dataclasses.dataclass(frozen=True)
class PallasTpuBackend:
    """interpret: None = interpret unless jax's default backend is TPU; True/False; or a
    `pltpu.InterpretParams` for the TPU-faithful interpreter. Compiling ahead of time for a TPU
    topology from a CPU host needs interpret=False (see `for_device`).
    chip: 'v5e' | 'v5p' | 'v6e' | 'tpu7x' for default tiles and VMEM limits; None = the local
    TPU's generation, else tiling.FALLBACK_CHIP.
    """

    interpret: Any = None
    chip: str | None = None
    name: ClassVar[str] = "pallas_tpu"

    @classmethod
    def for_device(cls, device) -> PallasTpuBackend:
        """Compiles for `device` (e.g. a topology device for AOT compiles)."""
        on_tpu = device.platform == "tpu"
        chip = tiling_lib.chip_from_device_kind(device.device_kind) if on_tpu else None
        return cls(interpret=not on_tpu, chip=chip)

    def _interpret(self):
        return jax.default_backend() != "tpu" if self.interpret is None else self.interpret

    def _chip(self) -> str:
        if self.chip is not None:
            return tiling_lib.check_chip(self.chip)
        if jax.default_backend() == "tpu":
            kind = jax.devices()[0].device_kind
            return tiling_lib.chip_from_device_kind(kind) or tiling_lib.FALLBACK_CHIP
        return tiling_lib.FALLBACK_CHIP

    def gmm(
        self,
        lhs,
        rhs,
        group_sizes,
        *,
        preferred_element_type,
        transpose_rhs,
        group_offset,
        tiling,
        existing_out=None,
    ):
        m, k = lhs.shape
        n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        chip = self._chip()
        tiles = tiling_lib.resolve_tiling(
            tiling, m, k, n, lhs.dtype, chip, num_groups=group_sizes.shape[0]
        )
        out_dtype = jnp.dtype(preferred_element_type)
        return _gmm_call(
            lhs,
            rhs,
            group_sizes,
            jnp.asarray(group_offset, jnp.int32),
            existing_out,
            tiles=tiles,
            out_dtype=out_dtype,
            transpose_rhs=transpose_rhs,
            interpret=self._interpret(),
            chip=chip,
        )

    def tgmm(
        self, lhs, rhs, group_sizes, *, num_groups, preferred_element_type, group_offset, tiling
    ):
        m, k = lhs.shape
        n = rhs.shape[1]
        chip = self._chip()
        tiles = tiling_lib.resolve_tiling(
            tiling, m, k, n, lhs.dtype, chip, num_groups=group_sizes.shape[0]
        )
        return _tgmm_call(
            lhs,
            rhs,
            group_sizes,
            jnp.asarray(group_offset, jnp.int32),
            num_groups=int(num_groups),
            tiles=tiles,
            out_dtype=jnp.dtype(preferred_element_type),
            interpret=self._interpret(),
            chip=chip,
        )


# --- gmm ---------------------------------------------------------------------------------------


def _gmm_call(
    lhs_MK,
    rhs,
    group_sizes_G,
    group_offset,
    existing_MN,
    *,
    tiles,
    out_dtype,
    transpose_rhs,
    interpret,
    chip,
):
    (m, k), num_local = lhs_MK.shape, rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = tiles
    _check_gmm_blocks(tiles, lhs_MK, rhs, out_dtype, transpose_rhs, m, n)
    meta = make_group_metadata(
        group_sizes_G, group_offset, num_local=num_local, m=m, tm=tm, visit_empty=False
    )
    t_max = max_visits(m, tm, num_local)

    def lhs_map(j, t, i, starts, ends, gids, tile_ids, num):
        return tile_ids[t], i

    def rhs_map(j, t, i, starts, ends, gids, tile_ids, num):
        return (gids[t], j, i) if transpose_rhs else (gids[t], i, j)

    def out_map(j, t, i, starts, ends, gids, tile_ids, num):
        return tile_ids[t], j

    rhs_block = (pl.squeezed, tn, tk) if transpose_rhs else (pl.squeezed, tk, tn)
    has_init = existing_MN is not None
    init_MN, init_spec, out_mn = _initial_out(
        existing_MN, m, n, tiles, out_dtype, interpret, out_map
    )
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
        _gmm_kernel, k=k, tm=tm, tk=tk, transpose_rhs=transpose_rhs, has_init=has_init
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_mn, out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_NUM_META,
            grid=(cdiv(n, tn), t_max, cdiv(k, tk)),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map), init_spec],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        input_output_aliases={_NUM_META + 2: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=tiling_lib.vmem_limit("gmm", tiles, needed, chip),
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="moetext_gmm",
    )(*meta, lhs_MK, rhs, init_MN)[:m, :n]


def _initial_out(existing_MN, m, n, tiles, out_dtype, interpret, out_map):
    """The buffer the gmm output aliases: (init [M', N'], its BlockSpec, output shape M', N').

    Row tiles no visit touches keep init: zeros, or existing_out. Without existing_out the
    kernel never reads init, so on TPU it stays in HBM (no DMA). The interpreters give an
    aliased output the input's buffer as padded for the input's block, so there init gets the
    output's block, and the TPU interpreter, which then returns that padded buffer, gets whole
    blocks (the caller slices them off).
    """
    tm, _, tn = tiles
    if existing_MN is None:
        init_MN = jnp.zeros((m, n), out_dtype)
    else:
        init_MN = existing_MN.astype(out_dtype)
    init_spec = pl.BlockSpec(memory_space=pl.ANY)
    if existing_MN is not None or interpret is not False:
        init_spec = pl.BlockSpec((tm, tn), out_map)
    out_mn = (m, n)
    if isinstance(interpret, pltpu.InterpretParams):
        out_mn = (cdiv(m, tm) * tm, cdiv(n, tn) * tn)
        init_MN = jnp.pad(init_MN, ((0, out_mn[0] - m), (0, out_mn[1] - n)))
    return init_MN, init_spec, out_mn


def _gmm_kernel(
    starts_L,
    ends_L,
    gids_T,
    tiles_T,
    num_1,
    lhs_ref,
    rhs_ref,
    init_ref,
    out_ref,
    acc_ref,
    *,
    k,
    tm,
    tk,
    transpose_rhs,
    has_init,
):
    t, ki = pl.program_id(1), pl.program_id(2)
    last_k = pl.num_programs(2) - 1
    num_visits = num_1[0]

    def base():  # what rows outside the visited group hold before any visit
        return init_ref[...] if has_init else jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(t < num_visits)
    def _visit():
        @pl.when(ki == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        contract = (1,) if transpose_rhs else (0,)

        def accumulate(mask_tail: bool):
            lhs, rhs = lhs_ref[...], rhs_ref[...]
            if mask_tail:
                lhs = _mask_cols(lhs, 1, ki * tk, k)
                rhs = _mask_cols(rhs, 1 if transpose_rhs else 0, ki * tk, k)
            acc_ref[...] += jax.lax.dot_general(
                lhs, rhs, (((1,), contract), ((), ())), preferred_element_type=jnp.float32
            )

        if k % tk:  # only the last K block runs past K; the masks cost VPU time elsewhere
            pl.when(ki == last_k)(lambda: accumulate(True))
            pl.when(ki != last_k)(lambda: accumulate(False))
        else:
            accumulate(False)

        @pl.when(ki == last_k)
        def _store():
            g, tile = gids_T[t], tiles_T[t]
            rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
            mine = (rows >= starts_L[g]) & (rows < ends_L[g])
            acc = acc_ref[...].astype(out_ref.dtype)
            # The first visit of a tile sees an uninitialised output buffer; later visits
            # (other groups sharing the tile) keep what earlier ones stored.
            first = (t == 0) | (tiles_T[jnp.maximum(t - 1, 0)] != tile)

            @pl.when(first)
            def _():
                out_ref[...] = jnp.where(mine, acc, base())

            @pl.when(jnp.logical_not(first))
            def _():
                out_ref[...] = jnp.where(mine, acc, out_ref[...])

    # No local rows at all: the grid still maps one output block, which must not be garbage.
    @pl.when((num_visits == 0) & (t == 0) & (ki == last_k))
    def _empty():
        out_ref[...] = base()


def _mask_cols(x, axis: int, start, limit: int):
    """Zeroes the entries of x at positions >= limit along `axis` (K tail past the array)."""
    pos = start + jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(pos < limit, x, jnp.zeros((), x.dtype))


def _check_gmm_blocks(tiles, lhs, rhs, out_dtype, transpose_rhs, m, n):
    tm, tk, tn = tiles
    tiling_lib.check_block("gmm", tiles, "lhs", lhs.shape, lhs.dtype, (("tm", tm), ("tk", tk)))
    rhs_block = (("tn", tn), ("tk", tk)) if transpose_rhs else (("tk", tk), ("tn", tn))
    tiling_lib.check_block("gmm", tiles, "rhs", rhs.shape, rhs.dtype, rhs_block)
    tiling_lib.check_block("gmm", tiles, "out", (m, n), out_dtype, (("tm", tm), ("tn", tn)))


# --- tgmm --------------------------------------------------------------------------------------


def _tgmm_call(
    lhs_MK, rhs_MN, group_sizes_G, group_offset, *, num_groups, tiles, out_dtype, interpret, chip
):
    (m, k), n = lhs_MK.shape, rhs_MN.shape[1]
    tm, tk, tn = tiles
    for name, x, block in (
        ("lhs", lhs_MK, (("tm", tm), ("tk", tk))),
        ("rhs", rhs_MN, (("tm", tm), ("tn", tn))),
    ):
        tiling_lib.check_block("tgmm", tiles, name, x.shape, x.dtype, block)
    tiling_lib.check_block("tgmm", tiles, "out", (k, n), out_dtype, (("tk", tk), ("tn", tn)))
    meta = make_group_metadata(
        group_sizes_G, group_offset, num_local=num_groups, m=m, tm=tm, visit_empty=True
    )
    t_max = max_visits(m, tm, num_groups)

    def lhs_map(i, j, t, starts, ends, gids, tile_ids, num):
        return tile_ids[t], i

    def rhs_map(i, j, t, starts, ends, gids, tile_ids, num):
        return tile_ids[t], j

    def out_map(i, j, t, starts, ends, gids, tile_ids, num):
        return gids[t], i, j

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
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_NUM_META,
            grid=(tiles_k, tiles_n, t_max),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), rhs_map)],
            out_specs=pl.BlockSpec((pl.squeezed, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tiling_lib.vmem_limit("tgmm", tiles, needed, chip),
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="moetext_tgmm",
    )(*meta, lhs_MK, rhs_MN)


def _tgmm_kernel(
    starts_L, ends_L, gids_T, tiles_T, num_1, lhs_ref, rhs_ref, out_ref, acc_ref, *, tm
):
    t, last_t = pl.program_id(2), pl.num_programs(2) - 1
    num_visits = num_1[0]
    g, tile = gids_T[t], tiles_T[t]
    first = (t == 0) | (gids_T[jnp.maximum(t - 1, 0)] != g)
    last = (t == num_visits - 1) | (gids_T[jnp.minimum(t + 1, last_t)] != g)

    @pl.when(t < num_visits)
    def _visit():
        @pl.when(first)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        def own_rows(x):
            # Masks both operands: rows past M hold garbage (maybe NaN), and NaN * 0 is NaN.
            rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
            mine = (rows >= starts_L[g]) & (rows < ends_L[g])
            return jnp.where(mine, x, jnp.zeros((), x.dtype))

        def accumulate(mask_rows: bool):
            lhs, rhs = lhs_ref[...], rhs_ref[...]
            if mask_rows:
                lhs, rhs = own_rows(lhs), own_rows(rhs)
            acc_ref[...] += jax.lax.dot_general(
                lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )

        # Most tiles lie inside their group (ends <= M, so no rows past M either): skip the
        # masks there, they cost VPU time on every [tm, tk] and [tm, tn] element.
        inside = (tile * tm >= starts_L[g]) & (tile * tm + tm <= ends_L[g])
        pl.when(inside)(lambda: accumulate(False))
        pl.when(jnp.logical_not(inside))(lambda: accumulate(True))

        @pl.when(last)
        def _():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)


register("pallas_tpu", PallasTpuBackend)
