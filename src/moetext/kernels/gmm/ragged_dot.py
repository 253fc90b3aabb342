"""Backend over jax.lax.ragged_dot / ragged_dot_general (XLA's own grouped matmul)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, TilingArg, register
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

    def gmm(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        *,
        preferred_element_type: DTypeLike,
        transpose_rhs: bool,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        del tiling
        m = lhs.shape[0]
        sizes, mask = local_window(group_sizes, group_offset, rhs.shape[0], m)
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        out = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred_element_type)
        return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))

    def tgmm(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        *,
        num_groups: int,
        preferred_element_type: DTypeLike,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        del tiling
        m = lhs.shape[0]
        sizes, mask = local_window(group_sizes, group_offset, num_groups, m)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        rhs = jnp.where(mask[:, None], rhs, jnp.zeros((), rhs.dtype))
        dims = RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([0], [0]), ([], [])),
            lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[],
        )
        return jax.lax.ragged_dot_general(
            lhs, rhs, sizes, dims, preferred_element_type=preferred_element_type
        )


register("ragged_dot", RaggedDotBackend)
