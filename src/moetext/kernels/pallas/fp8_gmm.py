"""Pallas TPU grouped matmuls on FP8 operands with per-block scales: gmm_fp8 (here), tgmm_fp8
(fp8_tgmm.py), and the helpers both share.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups (group_offset ..
group_offset + L - 1), T grid steps along the group axis (common.py), tm/tk/tn tiles,
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
The group schedule, block specs of lhs/rhs/out, the visit/store skeleton and the zero-initialised
aliased output are common.py's, shared with the bf16 kernels (gmm_kernels.py).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import ArrayLike, DTypeLike

from moetext.kernels.pallas import tiling as tiling_lib
from moetext.kernels.pallas.common import (
    GMM_DIMENSIONS,
    NUM_META,
    Interpret,
    Ref,
    cdiv,
    gmm_aliased_out,
    gmm_block_specs,
    gmm_step,
    grouped_grid_spec,
    make_group_metadata,
    max_visits,
    on_gmm_grid,
    resolve_interpret,
    round_up,
    split_refs,
)
from moetext.kernels.pallas.tiling import Tiling, TilingArg
from moetext.kernels.typed_jax import ShapeDtypeStruct

# Chips whose MXU multiplies FP8 natively; elsewhere the tile is widened to bf16 in VMEM (exact:
# every e4m3/e5m2 value is a bf16 value), which still halves HBM traffic against bf16 operands.
NATIVE_FP8_CHIPS = frozenset({"tpu7x"})


def scale_blocks(ls: tuple[int, int], rs: tuple[int, int]) -> list[tiling_lib.Block]:
    """The VMEM blocks of an FP8 kernel's float32 scales ls [rows, nb] and rs [nb, cols] (nb
    scale blocks), the nb dim padded to the (8, 128) float32 layout tile: lanes for ls,
    sublanes for rs."""
    return [(ls[0], max(ls[1], 128), jnp.float32), (max(rs[0], 8), rs[1], jnp.float32)]


def mxu_dtype(chip: str, interpret: Interpret) -> jnp.dtype | None:
    """The dtype FP8 tiles are widened to before the dot; None feeds FP8 to the MXU as is."""
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


def fp8_tiling(
    op: str,
    tiling: TilingArg,
    m: int,
    k: int,
    n: int,
    chip: str,
    num_groups: int,
    bs: int,
    blocked: Literal["k", "m"],
) -> Tiling:
    """(tm, tk, tn) with the scale-blocked tile (tk if blocked == "k", tm if "m") a multiple
    of bs; an explicit tiling that breaks this is a ValueError."""
    fixed = None if tiling is None or callable(tiling) else tiling
    explicit = fixed is not None
    tm, tk, tn = tiling_lib.resolve_tiling(
        tiling, m, k, n, jnp.float8_e4m3fn, chip, num_groups=num_groups
    )
    if blocked == "k":
        tk = _fit_block(k, tk, bs, op, "tk", explicit)
    else:
        tm = min(tm if fixed is None else fixed[0], round_up(m, bs))
        if tm % bs:
            if explicit:
                raise ValueError(f"{op}: tm={tm} must be a multiple of block_size={bs}")
            tm = round_up(tm, bs)
    return tm, tk, tn


def gmm_fp8(
    lhs_q: jax.Array,
    lhs_scale: jax.Array,
    rhs_q: jax.Array,
    rhs_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: ArrayLike = 0,
    transpose_rhs: bool = False,
    block_size: int = 128,
    tiling: TilingArg = None,
    preferred_element_type: DTypeLike = jnp.bfloat16,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """[M, N] = per-group lhs @ rhs on FP8 values: lhs_q [M, K], lhs_scale [M, K/bs];
    rhs_q [L, K, N] with rhs_scale [L, K/bs, N], or [L, N, K] with [L, N, K/bs] when
    transpose_rhs. K must be a multiple of block_size: fp8_blockwise's caller,
    `PallasFp8Kernels.gmm` (quant/scaled_kernels.py), pads K to whole blocks with FP8 zeros. Rows
    outside the local groups are zero."""
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
    chip, interpret = tiling_lib.resolve_chip(chip), resolve_interpret(interpret)
    tiles = fp8_tiling("gmm_fp8", tiling, m, k, n, chip, group_sizes.shape[0], bs, "k")
    tm, tk, tn = tiles
    out_dtype = jnp.dtype(preferred_element_type)
    tiling_lib.check_gmm_blocks(
        "gmm_fp8", tiles, lhs_q, rhs_q, out_dtype, transpose_rhs=transpose_rhs
    )
    meta = make_group_metadata(
        group_sizes, group_offset, num_local=num_local, m=m, tm=tm, visit_empty=False
    )
    ls = lhs_scale.astype(jnp.float32)  # [M, nb]
    rs = rhs_scale.astype(jnp.float32)
    rs = jnp.swapaxes(rs, 1, 2) if transpose_rhs else rs  # [L, nb, N]
    lhs_spec, rhs_spec, out_spec = gmm_block_specs(tm, tk, tn, transpose_rhs=transpose_rhs)
    # Every scale block of the row tile's rows and of the group's columns (nb is the full dim).
    ls_spec = pl.BlockSpec((tm, nb), on_gmm_grid(lambda j, k, v: (v.tile, 0)))
    rs_spec = pl.BlockSpec((pl.squeezed, nb, tn), on_gmm_grid(lambda j, k, v: (v.group, 0, j)))
    # Output aliases a zero buffer so tiles no local group visits read as zeros.
    init_MN, init_spec, out_mn = gmm_aliased_out(None, m, n, tiles, out_dtype, interpret)
    needed = tiling_lib.vmem_bytes(
        [(tm, tk, lhs_q.dtype), (tk, tn, rhs_q.dtype), *scale_blocks((tm, nb), (nb, tn))],
        (tm, tn, out_dtype),
        (tm, tn),
    )
    t_max = max_visits(m, tm, num_local)
    kernel = functools.partial(
        _gmm_kernel,
        tm=tm,
        bs=bs,
        sb=tk // bs,
        transpose_rhs=transpose_rhs,
        mxu=mxu_dtype(chip, interpret),
    )
    out_MN: jax.Array = pl.pallas_call(
        kernel,
        out_shape=ShapeDtypeStruct(out_mn, out_dtype),
        grid_spec=grouped_grid_spec(
            (cdiv(n, tn), t_max, k // tk),
            [lhs_spec, ls_spec, rhs_spec, rs_spec, init_spec],
            out_spec,
            (tm, tn),
        ),
        input_output_aliases={NUM_META + 4: 0},
        compiler_params=tiling_lib.compiler_params("gmm_fp8", GMM_DIMENSIONS, tiles, needed, chip),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * m * k * n,
            transcendentals=0,
            bytes_accessed=t_max * (tm * k * cdiv(n, tn) + k * n) + m * n * out_dtype.itemsize,
        ),
        name="moetext_gmm_fp8",
    )(*meta, lhs_q, ls, rhs_q, rs, init_MN)
    return out_MN[:m, :n]


def _gmm_kernel(
    *refs: Ref, tm: int, bs: int, sb: int, transpose_rhs: bool, mxu: jnp.dtype | None
) -> None:
    """acc[tm, tn] += (lhs[:, kb] @ rhs[kb, :]) * ls[kb][tm, 1] * rs[kb][1, tn] for the sb
    scale blocks kb of the K tile."""
    meta, (lhs_ref, ls_ref, rhs_ref, rs_ref, _init_ref, out_ref, acc_ref) = split_refs(refs)
    ki = pl.program_id(2)

    def accumulate() -> None:
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
            acc += part * pick_scale(ls, kb, axis=1) * pick_scale(rs, kb, axis=0)
        acc_ref[...] = acc

    # The aliased init is never read: tiles no visit touches keep its zeros.
    def zeros() -> jax.Array:
        return jnp.zeros(out_ref.shape, out_ref.dtype)

    gmm_step(meta, out_ref, acc_ref, tm=tm, accumulate=accumulate, base=zeros)


def pick_scale(scales: jax.Array, idx: jax.Array, *, axis: int) -> jax.Array:
    """Entry idx of `axis` as a broadcastable column (axis=1) or row (axis=0), by masked sum."""
    pos = jax.lax.broadcasted_iota(jnp.int32, scales.shape, axis)
    return jnp.sum(jnp.where(pos == idx, scales, 0.0), axis=axis, keepdims=True)
