"""Pallas TPU grouped matmuls on FP8 operands with per-block scales: gmm_fp8 (here), tgmm_fp8
(pallas_tgmm_fp8.py), and the helpers both share.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups (group_offset ..
group_offset + L - 1), T grid steps along the group axis (pallas_metadata), tm/tk/tn tiles,
bs the scale block size, nb = K / bs (gmm) or cdiv(M, bs) (tgmm) scale blocks.

Scales are applied as outer products after each bs-long slice of the contraction:
  gmm:  acc[tm, tn] += (lhs[:, kb] @ rhs[kb, :]) * ls[kb][tm, 1] * rs[kb][1, tn]
  tgmm: acc[tk, tn] += (lhs[mb, :].T @ rhs[mb, :]) * ls[mb][tk, 1] * rs[mb][1, tn]
so tk (gmm) and tm (tgmm) may be any multiple of bs: an unrolled subchannel loop walks the bs
slices of the tile. In tgmm a scale block of bs rows may hold rows of two groups; each group's
visit masks the other's rows before its slice's dot, so the shared block scale stays exact.

Scales reach the kernel lane-dense, as whole blocks along the scale-block axis: gmm [M, nb] in
(tm, nb) blocks and [L, nb, N] in (nb, tn); tgmm [K, Mb] in (tk, Mb) and [Mb, N] in (Mb, tn).
A full dim is always a legal block, and no unit dim gets padded to a (8, 128) tile in HBM (a
[nb, M, 1] layout would take 128x its size). The kernel picks block j's column (tm, 1) / row
(1, tn) by a masked sum over that axis: exact, cheap next to the bs-deep matmul, and free of
dynamic lane slicing.
Group schedule and the zero-initialised aliased output follow the bf16 pallas_tpu backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moetext.kernels.gmm import tiling as tiling_lib
from moetext.kernels.gmm.pallas_metadata import cdiv, make_group_metadata, max_visits

_NUM_META = 5  # starts_L, ends_L, group_ids_T, tile_ids_T, num_visits
# Chips whose MXU multiplies FP8 natively; elsewhere the tile is widened to bf16 in VMEM (exact:
# every e4m3/e5m2 value is a bf16 value), which still halves HBM traffic against bf16 operands.
NATIVE_FP8_CHIPS = frozenset({"tpu7x"})


def _chip(chip: str | None) -> str:
    if chip is not None:
        return tiling_lib.check_chip(chip)
    if jax.default_backend() == "tpu":
        kind = jax.devices()[0].device_kind
        return tiling_lib.chip_from_device_kind(kind) or tiling_lib.FALLBACK_CHIP
    return tiling_lib.FALLBACK_CHIP


def _mxu_dtype(chip: str, interpret) -> jnp.dtype | None:
    # Interpret mode runs on the host: f32 is exact for FP8 products and fastest on XLA:CPU.
    if interpret is not False:
        return jnp.dtype(jnp.float32)
    return None if chip in NATIVE_FP8_CHIPS else jnp.dtype(jnp.bfloat16)


def _fit_block(dim: int, want: int, bs: int, op: str, name: str, given: bool) -> int:
    """A multiple of bs dividing dim: `want` itself if given, else the largest <= want."""
    if given:
        if want % bs or dim % want:
            raise ValueError(
                f"{op}: {name}={want} must be a multiple of block_size={bs} that divides "
                f"{name[1].upper()}={dim}"
            )
        return want
    t = max(bs, min(want, dim) // bs * bs)
    while dim % t:
        t -= bs
    return t


def _tiles(op, tiling, m, k, n, chip, num_groups, bs, blocked: str):
    explicit = tiling is not None and not callable(tiling)
    tm, tk, tn = tiling_lib.resolve_tiling(
        tiling, m, k, n, jnp.float8_e4m3fn, chip, num_groups=num_groups
    )
    if blocked == "k":
        tk = _fit_block(k, tk, bs, op, "tk", explicit)
    else:
        m_pad = cdiv(m, bs) * bs
        tm = min(tiling[0] if explicit else tm, m_pad)
        if tm % bs:
            if explicit:
                raise ValueError(f"{op}: tm={tm} must be a multiple of block_size={bs}")
            tm = cdiv(tm, bs) * bs
    return tm, tk, tn


def _common(interpret, chip):
    chip = _chip(chip)
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    return chip, interpret


def gmm_fp8(
    lhs_q,
    lhs_scale,
    rhs_q,
    rhs_scale,
    group_sizes,
    *,
    group_offset=0,
    transpose_rhs=False,
    block_size=128,
    tiling=None,
    preferred_element_type=jnp.bfloat16,
    interpret=None,
    chip=None,
):
    """[M, N] = per-group lhs @ rhs on FP8 values: lhs_q [M, K], lhs_scale [M, K/bs];
    rhs_q [L, K, N] with rhs_scale [L, K/bs, N], or [L, N, K] with [L, N, K/bs] when
    transpose_rhs. K must be a multiple of block_size (QuantizedGmm pads). Rows outside the
    local groups are zero."""
    bs = int(block_size)
    (m, k), num_local = lhs_q.shape, rhs_q.shape[0]
    n = rhs_q.shape[1] if transpose_rhs else rhs_q.shape[2]
    nb = k // bs
    rs_want = (num_local, n, nb) if transpose_rhs else (num_local, nb, n)
    if k % bs or lhs_scale.shape != (m, nb) or rhs_scale.shape != rs_want:
        raise ValueError(
            f"gmm_fp8: need K % block_size == 0, lhs_scale [M, K/bs] and rhs_scale {rs_want}; got "
            f"lhs {lhs_q.shape} scale {lhs_scale.shape}, rhs {rhs_q.shape} scale "
            f"{rhs_scale.shape}, block_size={bs}"
        )
    chip, interpret = _common(interpret, chip)
    tm, tk, tn = tiles = _tiles("gmm_fp8", tiling, m, k, n, chip, group_sizes.shape[0], bs, "k")
    out_dtype = jnp.dtype(preferred_element_type)
    for name, shape, dt, blk in (
        ("lhs", lhs_q.shape, lhs_q.dtype, (("tm", tm), ("tk", tk))),
        (
            "rhs",
            rhs_q.shape,
            rhs_q.dtype,
            (("tn", tn), ("tk", tk)) if transpose_rhs else (("tk", tk), ("tn", tn)),
        ),
        ("out", (m, n), out_dtype, (("tm", tm), ("tn", tn))),
    ):
        tiling_lib.check_block("gmm_fp8", tiles, name, shape, dt, blk)
    meta = make_group_metadata(
        group_sizes,
        jnp.asarray(group_offset, jnp.int32),
        num_local=num_local,
        m=m,
        tm=tm,
        visit_empty=False,
    )
    ls = lhs_scale.astype(jnp.float32)  # [M, nb]
    rs = rhs_scale.astype(jnp.float32)
    rs = jnp.swapaxes(rs, 1, 2) if transpose_rhs else rs  # [L, nb, N]
    sb = tk // bs

    def lhs_map(j, t, i, starts, ends, gids, tids, num):
        return tids[t], i

    def ls_map(j, t, i, starts, ends, gids, tids, num):
        return tids[t], 0

    def rhs_map(j, t, i, starts, ends, gids, tids, num):
        return (gids[t], j, i) if transpose_rhs else (gids[t], i, j)

    def rs_map(j, t, i, starts, ends, gids, tids, num):
        return gids[t], 0, j

    def out_map(j, t, i, starts, ends, gids, tids, num):
        return tids[t], j

    # Output aliases a zero buffer so tiles no local group visits read as zeros (see pallas_tpu).
    init_spec = (
        pl.BlockSpec((tm, tn), out_map)
        if interpret is not False
        else pl.BlockSpec(memory_space=pl.ANY)
    )
    rhs_block = (pl.squeezed, tn, tk) if transpose_rhs else (pl.squeezed, tk, tn)
    needed = tiling_lib.vmem_bytes(
        [
            (tm, tk, lhs_q.dtype),
            (tk, tn, rhs_q.dtype),
            (tm, max(nb, 128), jnp.float32),
            (max(nb, 8), tn, jnp.float32),
        ],
        (tm, tn, out_dtype),
        (tm, tn),
    )
    t_max = max_visits(m, tm, num_local)
    kernel = functools.partial(
        _gmm_kernel,
        tm=tm,
        bs=bs,
        sb=sb,
        transpose_rhs=transpose_rhs,
        mxu=_mxu_dtype(chip, interpret),
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_NUM_META,
            grid=(cdiv(n, tn), t_max, k // tk),
            in_specs=[
                pl.BlockSpec((tm, tk), lhs_map),
                pl.BlockSpec((tm, nb), ls_map),
                pl.BlockSpec(rhs_block, rhs_map),
                pl.BlockSpec((pl.squeezed, nb, tn), rs_map),
                init_spec,
            ],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        input_output_aliases={_NUM_META + 4: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=tiling_lib.vmem_limit("gmm_fp8", tiles, needed, chip),
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=t_max * (tm * k * cdiv(n, tn) + k * n) + m * n * out_dtype.itemsize,
        ),
        name="moetext_gmm_fp8",
    )(*meta, lhs_q, ls, rhs_q, rs, jnp.zeros((m, n), out_dtype))


def _gmm_kernel(
    starts_L,
    ends_L,
    gids_T,
    tiles_T,
    num_1,
    lhs_ref,
    ls_ref,
    rhs_ref,
    rs_ref,
    init_ref,
    out_ref,
    acc_ref,
    *,
    tm,
    bs,
    sb,
    transpose_rhs,
    mxu,
):
    del init_ref  # only aliased: tiles no visit touches keep its zeros
    t, ki = pl.program_id(1), pl.program_id(2)
    last_k = pl.num_programs(2) - 1
    num_visits = num_1[0]

    @pl.when(t < num_visits)
    def _visit():
        @pl.when(ki == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        acc = acc_ref[...]
        ls, rs = ls_ref[...], rs_ref[...]  # [tm, nb], [nb, tn]
        for s in range(sb):  # subchannel loop: one scale block of the contraction at a time
            cols = slice(s * bs, (s + 1) * bs)
            lhs = lhs_ref[:, cols]
            rhs = rhs_ref[:, cols] if transpose_rhs else rhs_ref[cols, :]
            if mxu is not None:
                lhs, rhs = lhs.astype(mxu), rhs.astype(mxu)
            part = jax.lax.dot_general(
                lhs,
                rhs,
                (((1,), (1,) if transpose_rhs else (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            kb = ki * sb + s
            acc += part * _pick(ls, kb, axis=1) * _pick(rs, kb, axis=0)
        acc_ref[...] = acc

        @pl.when(ki == last_k)
        def _store():
            g, tile = gids_T[t], tiles_T[t]
            rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
            mine = (rows >= starts_L[g]) & (rows < ends_L[g])
            res = acc_ref[...].astype(out_ref.dtype)
            first = (t == 0) | (tiles_T[jnp.maximum(t - 1, 0)] != tile)
            keep = jnp.where(first, jnp.zeros_like(res), out_ref[...])
            out_ref[...] = jnp.where(mine, res, keep)

    @pl.when((num_visits == 0) & (t == 0) & (ki == last_k))
    def _empty():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _pick(scales, idx, *, axis: int):
    """Entry idx of `axis` as a broadcastable column (axis=1) or row (axis=0), by masked sum."""
    pos = jax.lax.broadcasted_iota(jnp.int32, scales.shape, axis)
    return jnp.sum(jnp.where(pos == idx, scales, 0.0), axis=axis, keepdims=True)
