"""Pallas TPU tgmm on FP8 operands blocked along M (the reduction axis): tgmm_fp8.

Legend: M rows (sorted by group), K, N the output dims, L local groups, T grid steps along the
group axis (common.py), tm/tk/tn tiles, bs the scale block size, Mb = cdiv(M, tm) * tm /
bs scale blocks (padded to whole row tiles). The scheme is described in fp8_gmm.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike, DTypeLike

from moetext.kernels.pallas import tiling as tiling_lib
from moetext.kernels.pallas.common import (
    TGMM_DIMENSIONS,
    Interpret,
    Ref,
    cdiv,
    grouped_grid_spec,
    make_group_metadata,
    max_visits,
    on_tgmm_grid,
    resolve_interpret,
    split_refs,
    tgmm_block_specs,
    tgmm_step,
    zero_rows_outside,
)
from moetext.kernels.pallas.fp8_gmm import fp8_tiling, mxu_dtype, pick_scale, scale_blocks
from moetext.kernels.pallas.tiling import TilingArg
from moetext.kernels.typed_jax import ShapeDtypeStruct


def tgmm_fp8(
    lhs_q: jax.Array,
    lhs_scale: jax.Array,
    rhs_q: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int,
    group_offset: ArrayLike = 0,
    block_size: int = 128,
    tiling: TilingArg = None,
    preferred_element_type: DTypeLike = jnp.float32,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """[L, K, N] = per-group lhs.T @ rhs on FP8 values blocked along M (the reduction axis):
    lhs_q [M, K] with lhs_scale [cdiv(M, bs), K]; rhs_q [M, N] with rhs_scale [cdiv(M, bs), N].
    Empty groups give zeros."""
    bs = int(block_size)
    (m, k), n = lhs_q.shape, rhs_q.shape[1]
    mb = cdiv(m, bs)
    if rhs_q.shape[0] != m or lhs_scale.shape != (mb, k) or rhs_scale.shape != (mb, n):
        raise ValueError(
            f"tgmm_fp8: need lhs [M, K] with scale [cdiv(M, bs), K] and rhs [M, N] with scale "
            f"[cdiv(M, bs), N]; got lhs {lhs_q.shape} scale {lhs_scale.shape}, rhs "
            f"{rhs_q.shape} scale {rhs_scale.shape}, block_size={bs}"
        )
    chip, interpret = tiling_lib.resolve_chip(chip), resolve_interpret(interpret)
    tiles = fp8_tiling("tgmm_fp8", tiling, m, k, n, chip, group_sizes.shape[0], bs, "m")
    tm, tk, tn = tiles
    out_dtype = jnp.dtype(preferred_element_type)
    tiling_lib.check_tgmm_blocks("tgmm_fp8", tiles, lhs_q, rhs_q, out_dtype)
    meta = make_group_metadata(
        group_sizes, group_offset, num_local=num_groups, m=m, tm=tm, visit_empty=True
    )
    sb = tm // bs
    # Pad the scale blocks to whole row tiles with ones: the edge tile's blocks past M then hold
    # finite scales (its rows are masked to zero, and 0 * garbage could be NaN).
    mb_pad = cdiv(m, tm) * sb
    pad = ((0, mb_pad - mb), (0, 0))
    ls = jnp.pad(lhs_scale.astype(jnp.float32), pad, constant_values=1).T  # [K, Mb]
    rs = jnp.pad(rhs_scale.astype(jnp.float32), pad, constant_values=1)  # [Mb, N]
    lhs_spec, rhs_spec, out_spec = tgmm_block_specs(tm, tk, tn)
    # Every row block's scales, for the K tile's rows of ls and the N tile's columns of rs.
    ls_spec = pl.BlockSpec((tk, mb_pad), on_tgmm_grid(lambda i, j, v: (i, 0)))
    rs_spec = pl.BlockSpec((mb_pad, tn), on_tgmm_grid(lambda i, j, v: (0, j)))
    needed = tiling_lib.vmem_bytes(
        [(tm, tk, lhs_q.dtype), (tm, tn, rhs_q.dtype), *scale_blocks((tk, mb_pad), (mb_pad, tn))],
        (tk, tn, out_dtype),
        (tk, tn),
    )
    t_max = max_visits(m, tm, num_groups)
    out_LKN: jax.Array = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, bs=bs, sb=sb, mxu=mxu_dtype(chip, interpret)),
        out_shape=ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=grouped_grid_spec(
            (cdiv(k, tk), cdiv(n, tn), t_max),
            [lhs_spec, ls_spec, rhs_spec, rs_spec],
            out_spec,
            (tk, tn),
        ),
        compiler_params=tiling_lib.compiler_params(
            "tgmm_fp8", TGMM_DIMENSIONS, tiles, needed, chip
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=t_max * tm * (k * cdiv(n, tn) + n * cdiv(k, tk))
            + num_groups * k * n * out_dtype.itemsize,
        ),
        name="moetext_tgmm_fp8",
    )(*meta, lhs_q, ls, rhs_q, rs)
    return out_LKN


def _tgmm_kernel(*refs: Ref, tm: int, bs: int, sb: int, mxu: jnp.dtype | None) -> None:
    """acc[tk, tn] += (lhs[mb, :].T @ rhs[mb, :]) * ls[mb][tk, 1] * rs[mb][1, tn] for the sb
    scale blocks mb of the row tile, over the rows of the visited group."""
    meta, (lhs_ref, ls_ref, rhs_ref, rs_ref, out_ref, acc_ref) = split_refs(refs)

    def accumulate(tile: jax.Array, start: jax.Array, end: jax.Array) -> None:
        acc = acc_ref[...]
        ls, rs = ls_ref[...], rs_ref[...]  # [tk, Mb], [Mb, tn]: every row block's scales
        for s in range(sb):  # subchannel loop along M: each bs-row block has its own scales
            rows = slice(s * bs, (s + 1) * bs)
            lhs, rhs = lhs_ref[rows, :], rhs_ref[rows, :]
            if mxu is not None:
                lhs, rhs = lhs.astype(mxu), rhs.astype(mxu)
            row0 = tile * tm + s * bs
            # Both operands are masked: rows past M hold garbage (maybe NaN), NaN * 0 is NaN.
            lhs = zero_rows_outside(lhs, row0, start, end)
            rhs = zero_rows_outside(rhs, row0, start, end)
            part = jax.lax.dot_general(
                lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            mblk = tile * sb + s
            acc += part * pick_scale(ls, mblk, axis=1) * pick_scale(rs, mblk, axis=0)
        acc_ref[...] = acc

    tgmm_step(meta, out_ref, acc_ref, accumulate=accumulate)
