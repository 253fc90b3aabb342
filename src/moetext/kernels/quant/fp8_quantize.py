"""Symmetric absmax FP8 quantization: block-wise (quantize, quantize_tiles, dual_quantize) and
per tensor (quantize_tensorwise).

Legend: n the length of the quantized axis, bs the block size, nb = cdiv(n, bs) blocks.

A block is 1 x bs consecutive elements along `axis` (or bs x bs tiles, `quantize_tiles`).
scale = amax(|block|) * float32(1 / max_finite(dtype)) in float32, qvalue = x * float32(1 /
scale) rounded to `dtype` (nearest even, saturating), dequantize(q, s) = q * s; the rule is
kernels/fp8_scaling.py's, shared with QAG and the Pallas quantize kernel.
Conventions (docs/kernels.md, "Quantization recipes and FP8"):
  * ragged tail: n need not divide by bs; the last block covers the n % bs remaining elements
    (as if zero-padded, zeros never change an absmax). qvalue keeps x's shape, scale has nb.
  * all-zero block: scale 1.0 (q = 0, dequantizes to exact zeros, never 0/0).
  * tiny blocks: scale is at least the smallest normal float32, so x / scale stays finite;
    float32 subnormal inputs are flushed to zero by XLA (so an all-subnormal block is zero).
  * non-finite input: an inf or NaN makes its block's scale inf/NaN, so the whole block
    dequantizes to NaN (propagates, like a bf16 matmul would). `checked=True` raises instead.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.fp8_scaling import scale_from_amax, to_fp8
from moetext.kernels.pallas.common import Interpret, cdiv
from moetext.kernels.pallas.quantize_kernel import quantize_minor

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _check_args(x: jax.Array, axis: int, block_size: int, dtype: DTypeLike) -> int:
    if x.ndim == 0:
        raise ValueError(f"quantize: x must have at least one axis, got a scalar {x.shape}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize: axis {axis} out of range for x of shape {x.shape}")
    if int(block_size) <= 0:
        raise ValueError(f"quantize: block_size must be a positive int, got {block_size}")
    if jnp.dtype(dtype) not in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
        raise ValueError(f"quantize: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return axis % x.ndim


def pad_to(x: jax.Array, sizes: dict[int, int]) -> jax.Array:
    """Zero-pads axes up to sizes (a no-op, so no copy, when they already fit)."""
    pad = [(0, sizes.get(a, d) - d) for a, d in enumerate(x.shape)]
    return jnp.pad(x, pad) if any(hi for _, hi in pad) else x


def _amax(x: jax.Array, axis: int | tuple[int, ...]) -> jax.Array:
    # |x| and max are exact in x's own dtype; upcasting after the reduction keeps XLA from
    # materialising a float32 copy of x (2x a bf16 activation) shared by amax and the cast.
    return jnp.max(jnp.abs(x), axis=axis).astype(jnp.float32)


def _check_finite(x: jax.Array, op: str) -> None:
    def check(bad: jax.Array) -> None:
        if bad:
            raise ValueError(f"{op}: input holds inf or NaN (checked=True)")

    jax.debug.callback(check, jnp.logical_not(jnp.all(jnp.isfinite(x))))


def quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    block_size: int = 128,
    dtype: DTypeLike = E4M3,
    checked: bool = False,
    impl: str = "auto",
    interpret: Interpret | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(qvalue, scale): absmax FP8 quantization per 1 x block_size block along `axis`.

    qvalue has x's shape and `dtype`; scale is float32 with x's shape except nb blocks on axis.
    impl: "xla", "pallas" (pallas/quantize_kernel.py, for blocks along the last axis when it
    divides by block_size; `interpret` as in the Pallas kernels) or "auto" (pallas on TPU where
    it applies).
    """
    axis = _check_args(x, axis, block_size, dtype)
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"quantize: impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if checked:
        _check_finite(x, "quantize")
    n, bs = x.shape[axis], int(block_size)
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "tpu" else "xla"
    if impl == "pallas" and axis == x.ndim - 1 and n % bs == 0:
        # XLA on TPU relayouts a minor-dim segmented amax through a full float32 copy.
        return quantize_minor(x, block_size=bs, dtype=dtype, interpret=interpret)
    nb = cdiv(n, bs)
    xp = pad_to(x, {axis: nb * bs})
    xb = xp.reshape(x.shape[:axis] + (nb, bs) + x.shape[axis + 1 :])
    scale = scale_from_amax(_amax(xb, axis + 1), dtype)
    q = to_fp8(xb, jnp.expand_dims(scale, axis + 1), dtype).reshape(xp.shape)
    return jax.lax.slice_in_dim(q, 0, n, axis=axis), scale


def quantize_tensorwise(
    x: jax.Array, *, axes: tuple[int, ...] | None = None, dtype: DTypeLike = E4M3
) -> tuple[jax.Array, jax.Array]:
    """(qvalue, scale): absmax FP8 quantization with one scale per slice over `axes`.

    axes None: one scale for the whole tensor. scale is float32 with x's rank, size 1 along
    `axes` (so `qvalue * scale` broadcasts); qvalue has x's shape and `dtype`. The conventions of
    `quantize` hold with the slice as the block: an all-zero slice gets scale 1, tiny ones the
    smallest normal float32, and an inf or NaN poisons its whole slice.
    """
    _check_args(x, -1, 1, dtype)
    axes = tuple(range(x.ndim)) if axes is None else tuple(sorted(a % x.ndim for a in axes))
    scale = scale_from_amax(_amax_keepdims(x, axes), dtype)
    return to_fp8(x, scale, dtype), scale


def _amax_keepdims(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.max(jnp.abs(x), axis=axes, keepdims=True).astype(jnp.float32)


def expand_scale(scale: jax.Array, n: int, *, axis: int = -1, block_size: int = 128) -> jax.Array:
    """Per-block scales repeated to per-element along `axis`, cut to length n."""
    s = jnp.repeat(scale, int(block_size), axis=axis)
    return jax.lax.slice_in_dim(s, 0, n, axis=axis % scale.ndim)


def dequantize(
    qvalue: jax.Array,
    scale: jax.Array,
    *,
    axis: int = -1,
    block_size: int = 128,
    dtype: DTypeLike = jnp.bfloat16,
) -> jax.Array:
    """qvalue * scale (scale broadcast over each block of `axis`), cast to `dtype`."""
    axis %= qvalue.ndim
    nb = cdiv(qvalue.shape[axis], int(block_size))
    want = qvalue.shape[:axis] + (nb,) + qvalue.shape[axis + 1 :]
    if scale.shape != want:
        raise ValueError(
            f"dequantize: scale shape {scale.shape} does not fit qvalue {qvalue.shape} with "
            f"axis={axis}, block_size={block_size}; expected {want}"
        )
    s = expand_scale(scale, qvalue.shape[axis], axis=axis, block_size=block_size)
    return (qvalue.astype(jnp.float32) * s).astype(dtype)


def quantize_tiles(
    x: jax.Array, *, block_size: int = 128, dtype: DTypeLike = E4M3, checked: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(qvalue, scale) with one scale per block_size x block_size tile of the last two axes.

    scale: [..., cdiv(R, bs), cdiv(C, bs)] float32. A tile scale serves a matmul contracting
    either axis, so weights quantized this way need no second orientation for the backward.
    """
    if x.ndim < 2:
        raise ValueError(f"quantize_tiles: x must have at least two axes, got {x.shape}")
    _check_args(x, -1, block_size, dtype)
    if checked:
        _check_finite(x, "quantize_tiles")
    (r, c), bs = x.shape[-2:], int(block_size)
    rb, cb = cdiv(r, bs), cdiv(c, bs)
    xp = pad_to(x, {x.ndim - 2: rb * bs, x.ndim - 1: cb * bs})
    xt = xp.reshape(x.shape[:-2] + (rb, bs, cb, bs))
    scale = scale_from_amax(_amax(xt, (-3, -1)), dtype)
    q = to_fp8(xt, scale[..., :, None, :, None], dtype).reshape(xp.shape)
    return q[..., :r, :c], scale


def dequantize_tiles(
    qvalue: jax.Array, scale: jax.Array, *, block_size: int = 128, dtype: DTypeLike = jnp.bfloat16
) -> jax.Array:
    r, c = qvalue.shape[-2:]
    s = expand_scale(
        expand_scale(scale, r, axis=-2, block_size=block_size), c, axis=-1, block_size=block_size
    )
    return (qvalue.astype(jnp.float32) * s).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """One quantization of an array: FP8 values, float32 block scales, and how they pair up.

    axis: the blocked axis (non-negative), or None for bs x bs tiles of the last two axes.
    """

    value: jax.Array
    scale: jax.Array
    axis: int | None = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(
        cls,
        x: jax.Array,
        *,
        axis: int | None,
        block_size: int = 128,
        dtype: DTypeLike = E4M3,
        impl: str = "auto",
        interpret: Interpret | None = None,
    ) -> Quantized:
        if axis is None:
            q, s = quantize_tiles(x, block_size=block_size, dtype=dtype)
            return cls(q, s, None, int(block_size))
        q, s = quantize(
            x, axis=axis, block_size=block_size, dtype=dtype, impl=impl, interpret=interpret
        )
        return cls(q, s, axis % x.ndim, int(block_size))

    def dequantize(self, dtype: DTypeLike = jnp.bfloat16) -> jax.Array:
        if self.axis is None:
            return dequantize_tiles(self.value, self.scale, block_size=self.block_size, dtype=dtype)
        return dequantize(
            self.value, self.scale, axis=self.axis, block_size=self.block_size, dtype=dtype
        )

    @property
    def nbytes(self) -> int:
        return self.value.size * self.value.dtype.itemsize + self.scale.size * 4


class DualQuantized(NamedTuple):
    """Both orientations of a matrix, each quantized from the high-precision source.

    rowwise: 1 x bs blocks along the last axis (a matmul contracting the last axis uses it);
    colwise: bs x 1 blocks along the second-to-last axis (for contracting that axis, e.g. the
    token axis M in the weight gradient tgmm).
    """

    rowwise: Quantized
    colwise: Quantized


def dual_quantize(x: jax.Array, *, block_size: int = 128, dtype: DTypeLike = E4M3) -> DualQuantized:
    """Rowwise and columnwise block quantizations of x (rank >= 2), both from x itself."""
    if x.ndim < 2:
        raise ValueError(f"dual_quantize: x must have at least two axes, got shape {x.shape}")
    return DualQuantized(
        Quantized.of(x, axis=x.ndim - 1, block_size=block_size, dtype=dtype),
        Quantized.of(x, axis=x.ndim - 2, block_size=block_size, dtype=dtype),
    )
