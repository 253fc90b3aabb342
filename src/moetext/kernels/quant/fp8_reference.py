"""Float64 NumPy oracles for FP8 quantization and the FP8 grouped matmuls (never jit-ed).

Legend: M rows (sorted by group), K contraction, N outputs, G groups (G_local = L local groups
starting at group_offset), bs block size, nb number of blocks.

These follow the definitions in kernels/fp8_scaling.py and fp8_quantize.py literally: per-block
amax, scale = amax * float32(1 / fmax) in float32 (the stored precision), float32(x *
float32(1 / scale)) clipped to +-fmax and rounded to FP8 by ml_dtypes (round to nearest even).
The matmul oracles multiply the dequantized operands in float64, which is what an exact FP8 dot
with per-block scales computes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

from moetext.kernels.typed_jax import finfo

F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]

_TINY = np.finfo(np.float32).tiny
_FP8: dict[str, type[np.generic]] = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


def _fp8(dtype: npt.DTypeLike) -> type[np.generic]:
    return _FP8[np.dtype(dtype).name]


def _fmax(fp8: type[np.generic]) -> float:
    return float(finfo(fp8).max)


def quantize_reference(
    x: npt.ArrayLike,
    *,
    axis: int = -1,
    block_size: int = 128,
    dtype: npt.DTypeLike = ml_dtypes.float8_e4m3fn,
) -> tuple[F64, F32]:
    """(qvalue as float64, scale as float32) for 1 x block_size blocks along axis."""
    x = np.asarray(x, np.float64)
    fp8 = _fp8(dtype)
    fmax = _fmax(fp8)
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    nb = -(-n // block_size)
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (nb * block_size - n,))], axis=-1)
    xb = xp.reshape(x.shape[:-1] + (nb, block_size))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(xb), axis=-1)
        # float32 product, as stored (amax of float32 input is exact in float32).
        scale = amax.astype(np.float32) * np.float32(1 / fmax)
        scale = np.where(amax == 0, np.float32(1), np.maximum(scale, _TINY)).astype(np.float32)
        inv = (np.float32(1) / scale)[..., None]
        q = np.clip(xb.astype(np.float32) * inv, -fmax, fmax)  # one float32 product
    q = q.astype(fp8).astype(np.float64).reshape(xp.shape)[..., :n]
    return np.moveaxis(q, -1, axis), np.moveaxis(scale, -1, axis)


def quantize_tensorwise_reference(
    x: npt.ArrayLike,
    *,
    axes: tuple[int, ...] | None = None,
    dtype: npt.DTypeLike = ml_dtypes.float8_e4m3fn,
) -> tuple[F64, F32]:
    """(qvalue as float64, scale as float32 with x's rank): one scale per slice over axes
    (None: the whole tensor), quantized like quantize_reference."""
    x = np.asarray(x, np.float64)
    fmax = _fmax(_fp8(dtype))
    axes = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(x), axis=axes, keepdims=True)
        scale = amax.astype(np.float32) * np.float32(1 / fmax)
        scale = np.where(amax == 0, np.float32(1), np.maximum(scale, _TINY)).astype(np.float32)
        q = np.clip(x.astype(np.float32) * (np.float32(1) / scale), -fmax, fmax)
    return q.astype(_fp8(dtype)).astype(np.float64), scale


def quantize_tiles_reference(
    x: npt.ArrayLike, *, block_size: int = 128, dtype: npt.DTypeLike = ml_dtypes.float8_e4m3fn
) -> tuple[F64, F32]:
    """(qvalue as float64, scale as float32) for block_size x block_size tiles of the last two
    axes: tile scales come from the tile amax; values are then quantized like quantize_reference
    with each element's tile scale."""
    x = np.asarray(x, np.float64)
    fmax = _fmax(_fp8(dtype))
    (r, c), bs = x.shape[-2:], block_size
    rb, cb = -(-r // bs), -(-c // bs)
    xp = np.zeros(x.shape[:-2] + (rb * bs, cb * bs))
    xp[..., :r, :c] = x
    xt = xp.reshape(x.shape[:-2] + (rb, bs, cb, bs))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(xt), axis=(-3, -1))
        scale = amax.astype(np.float32) * np.float32(1 / fmax)
        scale = np.where(amax == 0, np.float32(1), np.maximum(scale, _TINY)).astype(np.float32)
        inv = (np.float32(1) / scale)[..., :, None, :, None]
        q = np.clip(xt.astype(np.float32) * inv, -fmax, fmax)
    q = q.astype(_fp8(dtype)).astype(np.float64).reshape(xp.shape)[..., :r, :c]
    return q, scale


def dequantize_tiles_reference(
    q: npt.ArrayLike, scale: npt.ArrayLike, *, block_size: int = 128
) -> F64:
    q = np.asarray(q, np.float64)
    s = np.repeat(np.repeat(np.asarray(scale, np.float64), block_size, -2), block_size, -1)
    return q * s[..., : q.shape[-2], : q.shape[-1]]


def dequantize_reference(
    q: npt.ArrayLike, scale: npt.ArrayLike, *, axis: int = -1, block_size: int = 128
) -> F64:
    q = np.moveaxis(np.asarray(q, np.float64), axis, -1)
    s = np.repeat(np.moveaxis(np.asarray(scale, np.float64), axis, -1), block_size, axis=-1)
    with np.errstate(invalid="ignore"):
        return np.moveaxis(q * s[..., : q.shape[-1]], -1, axis)


def _windows(
    group_sizes: npt.ArrayLike, group_offset: int, num_local: int, m: int
) -> list[tuple[int, int]]:
    gs = np.asarray(group_sizes, np.int64)
    ends = np.minimum(np.cumsum(gs), m)
    starts = np.minimum(ends - gs, m)
    out = []
    for i in range(num_local):
        g = int(group_offset) + i
        out.append((int(starts[g]), int(ends[g])) if g < len(gs) else (m, m))
    return out


def gmm_fp8_reference(
    lhs_q: npt.ArrayLike,
    lhs_scale: npt.ArrayLike,
    rhs_q: npt.ArrayLike,
    rhs_scale: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    group_offset: int = 0,
    transpose_rhs: bool = False,
    block_size: int = 128,
) -> F64:
    """float64 [M, N]: lhs [M, K] with scales [M, nb]; rhs [L, K, N] with scales [L, nb, N]
    ([L, N, K] with scales [L, N, nb] when transpose_rhs). Rows outside local groups are 0."""
    lhs = dequantize_reference(lhs_q, lhs_scale, axis=1, block_size=block_size)
    rhs = dequantize_reference(
        rhs_q, rhs_scale, axis=2 if transpose_rhs else 1, block_size=block_size
    )
    if transpose_rhs:
        rhs = np.swapaxes(rhs, 1, 2)
    m = lhs.shape[0]
    out = np.zeros((m, rhs.shape[2]))
    for i, (s, e) in enumerate(_windows(group_sizes, group_offset, rhs.shape[0], m)):
        out[s:e] = lhs[s:e] @ rhs[i]
    return out


def tgmm_fp8_reference(
    lhs_q: npt.ArrayLike,
    lhs_scale: npt.ArrayLike,
    rhs_q: npt.ArrayLike,
    rhs_scale: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    num_groups: int,
    group_offset: int = 0,
    block_size: int = 128,
) -> F64:
    """float64 [L, K, N]: lhs [M, K] with scales [nb, K], rhs [M, N] with scales [nb, N]
    (blocks along M, the reduction axis)."""
    lhs = dequantize_reference(lhs_q, lhs_scale, axis=0, block_size=block_size)
    rhs = dequantize_reference(rhs_q, rhs_scale, axis=0, block_size=block_size)
    m = lhs.shape[0]
    out = np.zeros((num_groups, lhs.shape[1], rhs.shape[1]))
    for i, (s, e) in enumerate(_windows(group_sizes, group_offset, num_groups, m)):
        out[i] = lhs[s:e].T @ rhs[s:e]
    return out


def gmm_reference_f64(
    lhs: npt.ArrayLike,
    rhs: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    group_offset: int = 0,
    transpose_rhs: bool = False,
) -> F64:
    """Unquantized float64 grouped matmul, for measuring quantization error."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = np.swapaxes(rhs, 1, 2)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    for i, (s, e) in enumerate(_windows(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])):
        out[s:e] = lhs[s:e] @ rhs[i]
    return out


def tgmm_reference_f64(
    lhs: npt.ArrayLike,
    rhs: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    num_groups: int,
    group_offset: int = 0,
) -> F64:
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((num_groups, lhs.shape[1], rhs.shape[1]))
    for i, (s, e) in enumerate(_windows(group_sizes, group_offset, num_groups, lhs.shape[0])):
        out[i] = lhs[s:e].T @ rhs[s:e]
    return out
