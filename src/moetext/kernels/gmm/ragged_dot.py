"""Backend over jax.lax.ragged_dot / ragged_dot_general (XLA's own grouped matmul)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import Array

from moetext.kernels.gmm.backend import GmmBackend, GmmCall, register
from moetext.kernels.typed_jax import RaggedDotDimensionNumbers


def local_window(
    group_sizes: jax.Array, group_offset: jax.Array, num_local: int, m: int
) -> tuple[jax.Array, jax.Array]:
    """Group sizes for the local window and the mask of rows inside it.

    ragged_dot has no offset: the first local group also absorbs all earlier rows, which the
    mask zeroes, and the last absorbs nothing after the window (rows past it are masked too).
    """
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    idx = group_offset + jnp.arange(num_local)
    local = jnp.where(
        idx < group_sizes.shape[0], group_sizes[jnp.minimum(idx, group_sizes.shape[0] - 1)], 0
    )
    lo = starts[group_offset]
    local = local.at[0].add(lo)
    rows = jnp.arange(m)
    mask = (rows >= lo) & (rows < jnp.sum(local))
    return local.astype(jnp.int32), mask


@dataclasses.dataclass(frozen=True)
class RaggedDotBackend(GmmBackend):
    """jax.lax.ragged_dot for gmm, ragged_dot_general for tgmm; rows outside the window masked."""

    name: ClassVar[str] = "ragged_dot"

    def gmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        return self._masked_gmm(jax.lax.ragged_dot, lhs, rhs, group_sizes, call)

    @staticmethod
    def _masked_gmm(
        ragged_dot: Callable[..., jax.Array],
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        call: GmmCall,
    ) -> jax.Array:
        """ragged_dot(lhs, rhs, sizes) on the local window, rows outside it zeroed."""
        sizes, mask = local_window(group_sizes, call.group_offset, rhs.shape[0], lhs.shape[0])
        if call.transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        out = ragged_dot(lhs, rhs, sizes, preferred_element_type=call.out_dtype)
        return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))

    def tgmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        m, num_groups = lhs.shape[0], call.local_groups
        sizes, mask = local_window(group_sizes, call.group_offset, num_groups, m)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        rhs = jnp.where(mask[:, None], rhs, jnp.zeros((), rhs.dtype))
        dims = RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([0], [0]), ([], [])),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        )
        return jax.lax.ragged_dot_general(
            lhs, rhs, sizes, dims, preferred_element_type=call.out_dtype
        )


register("ragged_dot", RaggedDotBackend)
