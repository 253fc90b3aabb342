"""`ScaledKernels` implementations: grouped matmuls on block-quantized (`Quantized`) operands.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups, bs block size.

  * `DequantizedKernels(backend)`: any backend; its own gmm / tgmm on the dequantized operands.
    What a recipe uses when `backend.scaled_kernels()` is None.
  * `PallasFp8Kernels`: the FP8 Pallas kernels (pallas_fp8, pallas_tgmm_fp8) and the Pallas
    quantize kernel; `PallasTpuBackend.scaled_kernels()` returns one. It only adapts layouts:
    gmm_fp8 wants whole blocks along K (padded with FP8 zeros) and one scale per (K block,
    output column) for the weights, so bs x bs weight tiles get their scale repeated over the
    non-contraction axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.fp8.pallas_fp8 import gmm_fp8
from moetext.kernels.fp8.pallas_tgmm_fp8 import tgmm_fp8
from moetext.kernels.fp8.quantize import Quantized
from moetext.kernels.gmm.backend import GmmBackend, TilingArg


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

    def gmm(
        self,
        lhs: Quantized,
        rhs: Quantized,
        group_sizes: jax.Array,
        *,
        preferred_element_type: DTypeLike,
        transpose_rhs: bool,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        return self.backend.gmm(
            lhs.dequantize(self.dtype),
            rhs.dequantize(self.dtype),
            group_sizes,
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
            group_offset=group_offset,
            tiling=tiling,
        )

    def tgmm(
        self,
        lhs: Quantized,
        rhs: Quantized,
        group_sizes: jax.Array,
        *,
        num_groups: int,
        preferred_element_type: DTypeLike,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        return self.backend.tgmm(
            lhs.dequantize(self.dtype),
            rhs.dequantize(self.dtype),
            group_sizes,
            num_groups=num_groups,
            preferred_element_type=preferred_element_type,
            group_offset=group_offset,
            tiling=tiling,
        )


@dataclasses.dataclass(frozen=True)
class PallasFp8Kernels:
    """gmm_fp8 / tgmm_fp8 and the Pallas quantize kernel; `interpret` and `chip` as in
    PallasTpuBackend (interpret mode off TPU, the chip's tiles and VMEM limit)."""

    interpret: Any = None
    chip: str | None = None

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
            interpret=self.interpret,
        )

    def gmm(
        self,
        lhs: Quantized,
        rhs: Quantized,
        group_sizes: jax.Array,
        *,
        preferred_element_type: DTypeLike,
        transpose_rhs: bool,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        contract = 2 if transpose_rhs else 1
        bs = lhs.block_size
        k_pad = lhs.scale.shape[1] * bs  # gmm_fp8 wants whole blocks: pad K with FP8 zeros
        return gmm_fp8(
            _pad_axis(lhs.value, 1, k_pad),
            lhs.scale,
            _pad_axis(rhs.value, contract, k_pad),
            _per_column_scale(rhs, contract),
            group_sizes,
            group_offset=group_offset,
            transpose_rhs=transpose_rhs,
            block_size=bs,
            tiling=tiling,
            preferred_element_type=preferred_element_type,
            interpret=self.interpret,
            chip=self.chip,
        )

    def tgmm(
        self,
        lhs: Quantized,
        rhs: Quantized,
        group_sizes: jax.Array,
        *,
        num_groups: int,
        preferred_element_type: DTypeLike,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        return tgmm_fp8(
            lhs.value,
            lhs.scale,
            rhs.value,
            rhs.scale,
            group_sizes,
            num_groups=num_groups,
            group_offset=group_offset,
            block_size=lhs.block_size,
            tiling=tiling,
            preferred_element_type=preferred_element_type,
            interpret=self.interpret,
            chip=self.chip,
        )


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
