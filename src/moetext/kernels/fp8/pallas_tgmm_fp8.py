"""Pallas TPU tgmm on FP8 operands blocked along M (the reduction axis): tgmm_fp8.

Legend: M rows (sorted by group), K, N the output dims, L local groups, T grid steps along the
group axis (pallas_metadata), tm/tk/tn tiles, bs the scale block size, Mb = cdiv(M, tm) * tm /
bs scale blocks (padded to whole row tiles). The scheme is described in pallas_fp8.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moetext.kernels.fp8.pallas_fp8 import _NUM_META, _common, _mxu_dtype, _pick, _tiles
from moetext.kernels.gmm import tiling as tiling_lib
from moetext.kernels.gmm.pallas_metadata import cdiv, make_group_metadata, max_visits


def tgmm_fp8(
    lhs_q,
    lhs_scale,
    rhs_q,
    rhs_scale,
    group_sizes,
    *,
    num_groups,
    group_offset=0,
    block_size=128,
    tiling=None,
    preferred_element_type=jnp.float32,
    interpret=None,
    chip=None,
):
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
    chip, interpret = _common(interpret, chip)
    tm, tk, tn = tiles = _tiles("tgmm_fp8", tiling, m, k, n, chip, group_sizes.shape[0], bs, "m")
    out_dtype = jnp.dtype(preferred_element_type)
    for name, shape, dt, blk in (
        ("lhs", lhs_q.shape, lhs_q.dtype, (("tm", tm), ("tk", tk))),
        ("rhs", rhs_q.shape, rhs_q.dtype, (("tm", tm), ("tn", tn))),
        ("out", (k, n), out_dtype, (("tk", tk), ("tn", tn))),
    ):
        tiling_lib.check_block("tgmm_fp8", tiles, name, shape, dt, blk)
    meta = make_group_metadata(
        group_sizes,
        jnp.asarray(group_offset, jnp.int32),
        num_local=num_groups,
        m=m,
        tm=tm,
        visit_empty=True,
    )
    sb = tm // bs
    # Pad the scale blocks to whole row tiles with ones: the edge tile's blocks past M then hold
    # finite scales (its rows are masked to zero, and 0 * garbage could be NaN).
    mb_pad = cdiv(m, tm) * sb
    pad = ((0, mb_pad - mb), (0, 0))
    ls = jnp.pad(lhs_scale.astype(jnp.float32), pad, constant_values=1).T  # [K, Mb]
    rs = jnp.pad(rhs_scale.astype(jnp.float32), pad, constant_values=1)  # [Mb, N]

    def lhs_map(i, j, t, starts, ends, gids, tids, num):
        return tids[t], i

    def ls_map(i, j, t, starts, ends, gids, tids, num):
        return i, 0

    def rhs_map(i, j, t, starts, ends, gids, tids, num):
        return tids[t], j

    def rs_map(i, j, t, starts, ends, gids, tids, num):
        return 0, j

    def out_map(i, j, t, starts, ends, gids, tids, num):
        return gids[t], i, j

    needed = tiling_lib.vmem_bytes(
        [
            (tm, tk, lhs_q.dtype),
            (tm, tn, rhs_q.dtype),
            (tk, max(mb_pad, 128), jnp.float32),
            (max(mb_pad, 8), tn, jnp.float32),
        ],
        (tk, tn, out_dtype),
        (tk, tn),
    )
    t_max = max_visits(m, tm, num_groups)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, bs=bs, sb=sb, mxu=_mxu_dtype(chip, interpret)),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_NUM_META,
            grid=(cdiv(k, tk), cdiv(n, tn), t_max),
            in_specs=[
                pl.BlockSpec((tm, tk), lhs_map),
                pl.BlockSpec((tk, mb_pad), ls_map),
                pl.BlockSpec((tm, tn), rhs_map),
                pl.BlockSpec((mb_pad, tn), rs_map),
            ],
            out_specs=pl.BlockSpec((pl.squeezed, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tiling_lib.vmem_limit("tgmm_fp8", tiles, needed, chip),
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


def _tgmm_kernel(
    starts_L,
    ends_L,
    gids_T,
    tiles_T,
    num_1,
    lhs_ref,
    ls_ref,
    rhs_ref,
    rs_ref,
    out_ref,
    acc_ref,
    *,
    tm,
    bs,
    sb,
    mxu,
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

        acc = acc_ref[...]
        ls, rs = ls_ref[...], rs_ref[...]  # [tk, Mb], [Mb, tn]: every row block's scales
        for s in range(sb):  # subchannel loop along M: each bs-row block has its own scales
            rows = slice(s * bs, (s + 1) * bs)
            lhs, rhs = lhs_ref[rows, :], rhs_ref[rows, :]
            if mxu is not None:
                lhs, rhs = lhs.astype(mxu), rhs.astype(mxu)
            row0 = tile * tm + s * bs
            # Both operands are masked: rows past M hold garbage (maybe NaN), NaN * 0 is NaN.
            lhs = _own_rows(lhs, row0, starts_L[g], ends_L[g])
            rhs = _own_rows(rhs, row0, starts_L[g], ends_L[g])
            part = jax.lax.dot_general(
                lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            mblk = tile * sb + s
            acc += part * _pick(ls, mblk, axis=1) * _pick(rs, mblk, axis=0)
        acc_ref[...] = acc

        @pl.when(last)
        def _():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _own_rows(x, row0, start, end):
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where((rows >= start) & (rows < end), x, jnp.zeros((), x.dtype))
