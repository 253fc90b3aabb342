"""Optional backend "tokamax": tokamax.ragged_dot (registered only when tokamax imports).

Legend: M rows, K contraction, N outputs, G groups, L local groups.

tokamax picks its own kernel per platform (Mosaic TPU / Mosaic GPU / Triton / XLA). Its gmm
takes the same local-window arguments as jax.lax.ragged_dot, so the window handling of the
ragged_dot backend is reused; tgmm uses XLA's ragged_dot_general, which tokamax also wraps.
"""

from __future__ import annotations

import jax.numpy as jnp
import tokamax  # raises ImportError when absent; the package __init__ then skips this module

from moetext.kernels.gmm.backend import register
from moetext.kernels.gmm.ragged_dot import RaggedDotBackend, _local_sizes


class TokamaxBackend(RaggedDotBackend):
    name = "tokamax"

    def gmm(
        self, lhs, rhs, group_sizes, *, preferred_element_type, transpose_rhs, group_offset, tiling
    ):
        del tiling
        sizes, mask = _local_sizes(group_sizes, group_offset, rhs.shape[0], lhs.shape[0])
        if transpose_rhs:
            rhs = jnp.swapaxes(rhs, 1, 2)
        lhs = jnp.where(mask[:, None], lhs, jnp.zeros((), lhs.dtype))
        out = tokamax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred_element_type)
        return jnp.where(mask[:, None], out, jnp.zeros((), out.dtype))


register("tokamax", TokamaxBackend)
