"""Optional backend "tokamax": tokamax.ragged_dot (registered only when tokamax imports).

Legend: M rows, K contraction, N outputs, G groups, L local groups.

tokamax picks its own kernel per platform (Mosaic TPU / Mosaic GPU / Triton / XLA). Its gmm
takes the same local-window arguments as jax.lax.ragged_dot, so the window handling of the
ragged_dot backend is reused; tgmm uses XLA's ragged_dot_general, which tokamax also wraps.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import tokamax  # raises ImportError when absent; the package __init__ then skips this module
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import TilingArg, register
from moetext.kernels.gmm.ragged_dot import RaggedDotBackend, local_window


@dataclasses.dataclass(frozen=True)
class TokamaxBackend(RaggedDotBackend):
    """tokamax.ragged_dot for gmm (tokamax picks the kernel); tgmm as ragged_dot."""

    name: ClassVar[str] = "tokamax"

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
        sizes, mask = local_window(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        out = tokamax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred_element_type)
        return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))


register("tokamax", TokamaxBackend)
