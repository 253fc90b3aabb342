"""Grouped matmuls on block-quantized (`Quantized`) operands: the `ScaledKernels` protocol, its
two implementations, and which backend gets which.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups, bs block size.

  * `DequantizedKernels(backend)`: any backend; its own gmm / tgmm on the dequantized operands.
    What fp8_blockwise uses on a backend without fused kernels.
  * `PallasFp8Kernels(backend)`: the FP8 Pallas kernels (kernels/pallas: gmm_fp8, tgmm_fp8)
    and the Pallas quantize kernel, for the pallas_tpu backend. It only adapts layouts:
    gmm_fp8 wants whole blocks along K (padded with FP8 zeros) and one scale per (K block,
    output column) for the weights, so bs x bs weight tiles get their scale repeated over the
    non-contraction axis.

`scaled_kernels_for(backend)` picks the fused kernels registered for the backend's class
(`register_scaled_kernels`), or None. The pairing lives here, in the quantization room, so no
gmm backend knows about FP8.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall
from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend
from moetext.kernels.pallas.fp8_gmm import gmm_fp8
from moetext.kernels.pallas.fp8_tgmm import tgmm_fp8
from moetext.kernels.quant.fp8_quantize import Quantized


class ScaledKernels(Protocol):
    """Fused grouped matmuls on block-quantized operands.

    The operands are `Quantized` (values, float32 block scales, blocked axis, block size). The
    kernels accumulate the exact products of the low-precision values in float32 and apply
    each block's scales before adding it, so they compute exactly what multiplying the
    dequantized operands in float32 computes, up to float32 summation order.
    """

    def quantize(
        self, x: jax.Array, *, axis: int | None, block_size: int, dtype: DTypeLike
    ) -> Quantized:
        """`Quantized.of(x, ...)` the way these kernels want it fed (e.g. a Pallas quantize
        kernel on TPU); bit-identical to the XLA quantization."""
        ...

    def gmm(
        self,
        lhs: Quantized,  # [M, K], blocks along K
        rhs: Quantized,  # blocks along its contraction axis, or block_size^2 tiles
        group_sizes: jax.Array,
        call: GmmCall,
    ) -> jax.Array:
        """`GmmBackend.gmm` on the dequantized operands, fused."""
        ...

    def tgmm(
        self,
        lhs: Quantized,  # [M, K], blocks along M (the reduction axis)
        rhs: Quantized,  # [M, N], blocks along M
        group_sizes: jax.Array,
        call: GmmCall,
    ) -> jax.Array:
        """`GmmBackend.tgmm` on the dequantized operands, fused."""
        ...


_SCALED: dict[type[GmmBackend], Callable[[Any], ScaledKernels]] = {}


def register_scaled_kernels(
    backend_cls: type[GmmBackend], factory: Callable[[Any], ScaledKernels]
) -> None:
    """factory(backend) gives the fused kernels of every backend of `backend_cls` (subclasses
    included)."""
    _SCALED[backend_cls] = factory


def scaled_kernels_for(backend: GmmBackend) -> ScaledKernels | None:
    """The fused kernels registered for `backend`'s class, or None (recipes then dequantize
    and call the backend's own gmm / tgmm)."""
    for cls in type(backend).__mro__:
        if cls in _SCALED:
            return _SCALED[cls](backend)
    return None


@dataclasses.dataclass(frozen=True)
class DequantizedKernels:
    """`ScaledKernels` for any backend: its own gmm / tgmm on the dequantized operands, in
    `dtype` (float32: the products of FP8 values are exact, so only the summation order differs
    from a fused kernel). Quantization runs in XLA."""

    backend: GmmBackend
    dtype: str = "float32"

    def quantize(
        self, x: jax.Array, *, axis: int | None, block_size: int, dtype: DTypeLike
    ) -> Quantized:
        return Quantized.of(x, axis=axis, block_size=block_size, dtype=dtype, impl="xla")

    def gmm(self, lhs: Quantized, rhs: Quantized, group_sizes: Array, call: GmmCall) -> Array:
        return self.backend.gmm(
            lhs.dequantize(self.dtype), rhs.dequantize(self.dtype), group_sizes, call
        )

    def tgmm(self, lhs: Quantized, rhs: Quantized, group_sizes: Array, call: GmmCall) -> Array:
        return self.backend.tgmm(
            lhs.dequantize(self.dtype), rhs.dequantize(self.dtype), group_sizes, call
        )


@dataclasses.dataclass(frozen=True)
class PallasFp8Kernels:
    """gmm_fp8 / tgmm_fp8 and the Pallas quantize kernel, compiled as `backend` compiles its
    own kernels (interpret mode off TPU, the chip's tiles and VMEM limit)."""

    backend: PallasTpuBackend

    def quantize(
        self, x: jax.Array, *, axis: int | None, block_size: int, dtype: DTypeLike
    ) -> Quantized:
        # The Pallas kernel for last-axis blocks: XLA's TPU lowering of a minor-dim block amax
        # goes through a full float32 copy of x (docs/kernels.md, "Quantize kernel").
        return Quantized.of(
            x,
            axis=axis,
            block_size=block_size,
            dtype=dtype,
            impl="pallas",
            interpret=self.backend.interpret,
        )

    def gmm(self, lhs: Quantized, rhs: Quantized, group_sizes: Array, call: GmmCall) -> Array:
        contract = 2 if call.transpose_rhs else 1
        bs = lhs.block_size
        k_pad = lhs.scale.shape[1] * bs  # gmm_fp8 wants whole blocks: pad K with FP8 zeros
        return gmm_fp8(
            _pad_axis(lhs.value, 1, k_pad),
            lhs.scale,
            _pad_axis(rhs.value, contract, k_pad),
            _per_column_scale(rhs, contract),
            group_sizes,
            transpose_rhs=call.transpose_rhs,
            block_size=bs,
            **self.backend.kernel_options(call),
        )

    def tgmm(self, lhs: Quantized, rhs: Quantized, group_sizes: Array, call: GmmCall) -> Array:
        return tgmm_fp8(
            *(lhs.value, lhs.scale, rhs.value, rhs.scale, group_sizes),
            num_groups=call.local_groups,
            block_size=lhs.block_size,
            **self.backend.kernel_options(call),
        )


register_scaled_kernels(PallasTpuBackend, PallasFp8Kernels)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _per_column_scale(rq: Quantized, contract_axis: int) -> jax.Array:
    """rhs scales in gmm_fp8's layout: blocks along the contraction axis, one per column."""
    if rq.axis is not None:
        return rq.scale
    other = 3 - contract_axis  # tiles: repeat the tile scale over the non-contraction axis
    s = jnp.repeat(rq.scale, rq.block_size, axis=other)
    return jax.lax.slice_in_dim(s, 0, rq.value.shape[other], axis=other)
