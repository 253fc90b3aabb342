"""Pallas TPU kernel for 1 x bs block quantization along the minor (last) axis.

Legend: R rows (all leading dims merged), C the minor dim, bs block size, nb = C / bs, tr rows
per grid step.

Why a kernel: XLA on TPU lowers an amax over 128-lane segments of the minor dim (and the
broadcast of the scale back over them) with a full-size float32 relayout copy of the input:
2 GiB of temporaries per bf16 GiB quantized (measured on v5p AOT compiles, docs/kernels.md).
Here each row tile is read once into VMEM, and each bs-lane slice's amax is a lane reduction
of a (tr, bs) tile. The scale and the rounding are kernels/fp8_scaling.py's, as in
quant/fp8_quantize.py's XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from moetext.kernels.fp8_scaling import scale_from_amax, to_fp8
from moetext.kernels.pallas.common import Interpret, Ref, cdiv, resolve_interpret
from moetext.kernels.typed_jax import ShapeDtypeStruct

_TILE_BYTES = 2 << 20  # float32 bytes of one row tile in VMEM


def quantize_minor(
    x: jax.Array, *, block_size: int, dtype: DTypeLike, interpret: Interpret | None = None
) -> tuple[jax.Array, jax.Array]:
    """(qvalue, scale) for blocks along x's last axis; that axis must divide by block_size."""
    *lead, c = x.shape
    bs = int(block_size)
    if c % bs:
        raise ValueError(f"quantize_minor: last dim {c} must be a multiple of block_size {bs}")
    nb = c // bs
    x2 = x.reshape(-1, c)
    r = x2.shape[0]
    tr = max(32, min(1024, _TILE_BYTES // (4 * c)) // 32 * 32)
    tr = r if r <= tr else tr  # a block equal to the full dim is always legal
    q: jax.Array
    s: jax.Array
    q, s = pl.pallas_call(
        functools.partial(_kernel, bs=bs, nb=nb),
        out_shape=(ShapeDtypeStruct((r, c), dtype), ShapeDtypeStruct((r, nb), jnp.float32)),
        grid=(cdiv(r, tr),),
        in_specs=[pl.BlockSpec((tr, c), lambda i: (i, 0))],
        out_specs=(
            pl.BlockSpec((tr, c), lambda i: (i, 0)),
            pl.BlockSpec((tr, nb), lambda i: (i, 0)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=resolve_interpret(interpret),
        name="moetext_fp8_quantize",
    )(x2)
    return q.reshape(x.shape), s.reshape(*lead, nb)


def _kernel(x_ref: Ref, q_ref: Ref, s_ref: Ref, *, bs: int, nb: int) -> None:
    lane = jax.lax.broadcasted_iota(jnp.int32, s_ref.shape, 1)
    scales = jnp.ones(s_ref.shape, jnp.float32)
    for j in range(nb):  # static: one bs-lane slice per step, a lane reduction each
        blk = x_ref[:, j * bs : (j + 1) * bs].astype(jnp.float32)
        amax = jnp.max(jnp.abs(blk), axis=1, keepdims=True)
        # max may drop NaN (maxNum semantics); x * 0 is NaN exactly for inf/NaN x, so this sum
        # makes a non-finite block's scale NaN, as in the XLA path.
        amax = amax + jnp.sum(blk * 0, axis=1, keepdims=True)
        scale = scale_from_amax(amax, q_ref.dtype)
        q_ref[:, j * bs : (j + 1) * bs] = to_fp8(blk, scale, q_ref.dtype)
        scales = jnp.where(lane == j, scale, scales)
    s_ref[...] = scales
