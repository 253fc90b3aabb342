"""The fused MoE decode layer with D-split weights (fsdp): two Pallas TPU kernels around a psum.

With w_gate_up [E, D/P, 2F] and w_down [E, F, D/P] split along D over P shards, a shard holds
a slice of every expert. `fused_gate_up` gives its partial x_TD[:, slice] @ gate / up per
active slot ([S, T, F] each, f32); the caller sums them over the D shards (psum) before the
SiLU, scales by the combine weights (`slot_weights`), and `fused_down` multiplies h [S, T, F]
by the shard's [F, D/P] slab of each active expert: y's D/P columns, no further sum.

The single-kernel layer, its slot bookkeeping (`active_slots`) and the shared kernel pieces are
in kernels/pallas/moe_decode.py; the legend is its.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from moetext.kernels.pallas import tiling as tiling_lib
from moetext.kernels.pallas.common import Interpret, Ref, resolve_interpret, round_up
from moetext.kernels.pallas.moe_decode import (
    DIMENSIONS,
    HBM_SPEC,
    WeightStream,
    accumulate_slots,
    active_slots,
    default_block_f,
    down_window,
    gate_up_windows,
    in_hbm,
    matmul_f32,
    whole,
)
from moetext.kernels.typed_jax import ShapeDtypeStruct


def fused_gate_up(
    x_TD: jax.Array,
    slots_S: jax.Array,
    n_S: jax.Array,
    w_gate_up: jax.Array,
    *,
    block_f: int | None = None,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(g_STF, u_STF) f32: x_TD @ gate / up of expert slots_S[s] for s < n_S[0] (zero past
    it); x_TD [T, D'], w_gate_up [E, D', 2F] (D' = D or a shard's slice of it)."""
    (t, d), (_, d2, f2) = x_TD.shape, w_gate_up.shape
    if d2 != d or f2 % 2:
        raise ValueError(
            f"fused_gate_up: x_TD {tuple(x_TD.shape)} and w_gate_up {tuple(w_gate_up.shape)} "
            f"must be [T, D] and [E, D, 2F]"
        )
    f = f2 // 2
    tf, interpret, chip = _resolve(f, d, w_gate_up.dtype, block_f, interpret, chip)
    s, nf = slots_S.shape[0], f // tf
    tp = round_up(t, tiling_lib.sublanes(x_TD.dtype))
    x_pD = jnp.pad(x_TD, ((0, tp - t), (0, 0)))

    def out_map(s_: jax.Array, j: jax.Array, slots: Ref, n_ref: Ref) -> tuple[jax.Array, ...]:
        return s_, jnp.int32(0), j

    w_item = jnp.dtype(w_gate_up.dtype).itemsize
    out = ShapeDtypeStruct((s, tp, f), jnp.float32)
    needed = tiling_lib.vmem_bytes(
        [(tp, d, x_TD.dtype), (d, tf, w_gate_up.dtype), (d, tf, w_gate_up.dtype)],
        (2 * tp, tf, jnp.float32),
        (8, tiling_lib.LANES),
    )
    g, u = pl.pallas_call(
        functools.partial(_gate_up_kernel, f=f, tf=tf),
        out_shape=(out, out),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(s, nf),
            in_specs=[pl.BlockSpec((tp, d), whole), HBM_SPEC],
            out_specs=[
                pl.BlockSpec((pl.squeezed, tp, tf), out_map),
                pl.BlockSpec((pl.squeezed, tp, tf), out_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((2, d, tf), w_gate_up.dtype),
                pltpu.VMEM((2, d, tf), w_gate_up.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ],
        ),
        compiler_params=tiling_lib.compiler_params(
            "fused_gate_up", DIMENSIONS, (tp, d, tf), needed, chip
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * d * 2 * f * s,
            transcendentals=0,
            bytes_accessed=s * 2 * d * f * w_item
            + tp * d * x_TD.dtype.itemsize
            + 2 * s * tp * f * 4,
        ),
        name="moetext_fused_gate_up",
    )(slots_S, n_S, x_pD, in_hbm(w_gate_up))
    return g[:, :t], u[:, :t]


def _gate_up_kernel(
    slots_ref: Ref,
    n_ref: Ref,
    x_ref: Ref,
    w_gate_up: Ref,
    g_ref: Ref,
    u_ref: Ref,
    gate_buf: Ref,
    up_buf: Ref,
    sems: Ref,
    *,
    f: int,
    tf: int,
) -> None:
    si, j = pl.program_id(0), pl.program_id(1)
    gate, up = gate_up_windows(w_gate_up, f, tf)
    stream = WeightStream(slots_ref, n_ref, f // tf, [(gate, gate_buf), (up, up_buf)], sems)
    buf = stream.advance(si, j)
    active = si < n_ref[0]

    @pl.when(active)
    def _() -> None:
        g_ref[...] = matmul_f32(x_ref[...], gate_buf[buf])
        u_ref[...] = matmul_f32(x_ref[...], up_buf[buf])

    @pl.when(jnp.logical_not(active))
    def _() -> None:
        g_ref[...] = jnp.zeros(g_ref.shape, jnp.float32)
        u_ref[...] = jnp.zeros(u_ref.shape, jnp.float32)


def slot_weights(
    ids_TK: jax.Array, w_TK: jax.Array, slots_S: jax.Array, n_S: jax.Array
) -> jax.Array:
    """c_ST f32: the combine weight of slot s's expert for token t (zero past the active
    count, where slots repeat the last active expert)."""
    hit_STK = ids_TK[None] == slots_S[:, None, None]
    c_ST = jnp.sum(jnp.where(hit_STK, w_TK.astype(jnp.float32)[None], 0.0), axis=2)
    return jnp.where((jnp.arange(slots_S.shape[0]) < n_S[0])[:, None], c_ST, 0.0)


def fused_down(
    h_STF: jax.Array,
    slots_S: jax.Array,
    n_S: jax.Array,
    w_down: jax.Array,
    *,
    block_f: int | None = None,
    out_dtype: DTypeLike = jnp.float32,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """y_TD' = sum over active slots s of h_STF[s] @ w_down[slots_S[s]]; w_down [E, F, D']."""
    (s, t, f), (_, f2, d) = h_STF.shape, w_down.shape
    if f2 != f or slots_S.shape[0] != s:
        raise ValueError(
            f"fused_down: h_STF {tuple(h_STF.shape)}, slots {tuple(slots_S.shape)} and w_down "
            f"{tuple(w_down.shape)} must be [S, T, F], [S] and [E, F, D]"
        )
    tf, interpret, chip = _resolve(f, d, w_down.dtype, block_f, interpret, chip)
    nf = f // tf
    tp = round_up(t, tiling_lib.sublanes(h_STF.dtype))
    h_SpF = jnp.pad(h_STF, ((0, 0), (0, tp - t), (0, 0)))

    def h_map(s_: jax.Array, j: jax.Array, slots: Ref, n_ref: Ref) -> tuple[jax.Array, ...]:
        # Past the active count: the last active slot's last block, already in VMEM (no DMA).
        active = s_ < n_ref[0]
        last = jnp.maximum(n_ref[0] - 1, 0)
        return jnp.where(active, s_, last), jnp.int32(0), jnp.where(active, j, nf - 1)

    y_dtype = jnp.dtype(out_dtype)
    needed = tiling_lib.vmem_bytes(
        [(tp, tf, h_STF.dtype), (tf, d, w_down.dtype)], (tp, d, y_dtype), (tp, d)
    )
    y: jax.Array = pl.pallas_call(
        functools.partial(_down_kernel, num_slots=s, tf=tf),
        out_shape=ShapeDtypeStruct((tp, d), y_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(s, nf),
            in_specs=[pl.BlockSpec((pl.squeezed, tp, tf), h_map), HBM_SPEC],
            out_specs=pl.BlockSpec((tp, d), whole),
            scratch_shapes=[
                pltpu.VMEM((tp, d), jnp.float32),
                pltpu.VMEM((2, tf, d), w_down.dtype),
                pltpu.SemaphoreType.DMA((2, 1)),
            ],
        ),
        compiler_params=tiling_lib.compiler_params(
            "fused_down", DIMENSIONS, (tp, d, tf), needed, chip
        ),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(
            flops=2 * tp * f * d * s,
            transcendentals=0,
            bytes_accessed=s * f * d * jnp.dtype(w_down.dtype).itemsize
            + s * tp * f * h_STF.dtype.itemsize
            + tp * d * y_dtype.itemsize,
        ),
        name="moetext_fused_down",
    )(slots_S, n_S, h_SpF, in_hbm(w_down))
    return y[:t]


def _down_kernel(
    slots_ref: Ref,
    n_ref: Ref,
    h_ref: Ref,
    w_down: Ref,
    y_ref: Ref,
    acc_ref: Ref,
    down_buf: Ref,
    sems: Ref,
    *,
    num_slots: int,
    tf: int,
) -> None:
    num_f = w_down.shape[1] // tf
    stream = WeightStream(slots_ref, n_ref, num_f, [(down_window(w_down, tf), down_buf)], sems)
    buf = stream.advance(pl.program_id(0), pl.program_id(1))
    accumulate_slots(
        n_ref,
        acc_ref,
        y_ref,
        lambda _: matmul_f32(h_ref[...], down_buf[buf]),
        num_slots=num_slots,
        num_f=num_f,
    )


def _resolve(
    f: int,
    d: int,
    dtype: DTypeLike,
    block_f: int | None,
    interpret: Interpret | None,
    chip: str | None,
) -> tuple[int, Interpret, str]:
    """(tf, interpret, chip) of a D-split kernel, checked as `fused_moe` checks them."""
    tf = default_block_f(d, f, jnp.dtype(dtype).itemsize) if block_f is None else int(block_f)
    if tf <= 0 or f % tf or (tf % tiling_lib.LANES and tf != f):
        raise ValueError(
            f"fused MoE decode: block_f={block_f} must divide moe_intermediate_size F={f} and be "
            f"a multiple of {tiling_lib.LANES} (or F itself)"
        )
    interpret = resolve_interpret(interpret)
    if interpret is False and tf % tiling_lib.LANES:
        raise ValueError(
            f"fused MoE decode: moe_intermediate_size F={f} is not a multiple of "
            f"{tiling_lib.LANES}, which the kernel's blocks need on TPU; use "
            f"kernels.decode_moe=loop"
        )
    return tf, interpret, tiling_lib.resolve_chip(chip)


def split_reference(
    x_TD: jax.Array,
    ids_TK: jax.Array,
    w_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    block_f: int | None = None,
    interpret: Interpret | None = None,
) -> jax.Array:
    """fused_gate_up -> SwiGLU x slot weights -> fused_down on one device (no shards: the psum
    is the identity); what a D shard computes, for tests."""
    slots_S, n_S = active_slots(ids_TK, w_gate_up.shape[0])
    g, u = fused_gate_up(x_TD, slots_S, n_S, w_gate_up, block_f=block_f, interpret=interpret)
    c_ST = slot_weights(ids_TK, w_TK, slots_S, n_S)
    h = (c_ST[..., None] * jax.nn.silu(g) * u).astype(x_TD.dtype)
    return fused_down(
        h, slots_S, n_S, w_down, block_f=block_f, out_dtype=x_TD.dtype, interpret=interpret
    )
