"""Pallas TPU kernel for 1 x bs block quantization along the minor (last) axis.

Legend: R rows (all leading dims merged), C the minor dim, bs block size, nb = C / bs, tr rows
per grid step.

Why a kernel: XLA on TPU lowers an amax over 128-lane segments of the minor dim (and the
broadcast of the scale back over them) with a full-size float32 relayout copy of the input:
2 GiB of temporaries per bf16 GiB quantized (measured on v5p AOT compiles, docs/kernels.md).
Here each row tile is read once into VMEM, and each bs-lane slice's amax is a lane reduction
of a (tr, bs) tile. Same math as quantize.py (scale = amax * f32(1 / fmax), floored at the
smallest normal float32, 1 for all-zero blocks; q = clip(x * (1 / scale))).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from moetext.kernels.pallas_common import cdiv, resolve_interpret

_TINY = float(np.finfo(np.float32).tiny)
_TILE_BYTES = 2 << 20  # float32 bytes of one row tile in VMEM


def quantize_minor(x, *, block_size: int, dtype, interpret=None):
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
    q, s = pl.pallas_call(
        functools.partial(_kernel, bs=bs, nb=nb, fmax=float(jnp.finfo(dtype).max)),
        out_shape=(jax.ShapeDtypeStruct((r, c), dtype), jax.ShapeDtypeStruct((r, nb), jnp.float32)),
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


def _kernel(x_ref, q_ref, s_ref, *, bs, nb, fmax):
    lane = jax.lax.broadcasted_iota(jnp.int32, s_ref.shape, 1)
    scales = jnp.ones(s_ref.shape, jnp.float32)
    for j in range(nb):  # static: one bs-lane slice per step, a lane reduction each
        blk = x_ref[:, j * bs : (j + 1) * bs].astype(jnp.float32)
        amax = jnp.max(jnp.abs(blk), axis=1, keepdims=True)
        # max may drop NaN (maxNum semantics); x * 0 is NaN exactly for inf/NaN x, so this sum
        # makes a non-finite block's scale NaN, as in the XLA path.
        amax = amax + jnp.sum(blk * 0, axis=1, keepdims=True)
        scale = jnp.maximum(amax * np.float32(1 / fmax), _TINY)
        scale = jnp.where(amax == 0, jnp.float32(1), scale)
        q = jnp.clip(blk * (1 / scale), -fmax, fmax)
        q_ref[:, j * bs : (j + 1) * bs] = q.astype(q_ref.dtype)
        scales = jnp.where(lane == j, scale, scales)
    s_ref[...] = scales
