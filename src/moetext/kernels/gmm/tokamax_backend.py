"""Optional backend "tokamax": tokamax.ragged_dot (registered only when tokamax imports).

Legend: M rows, K contraction, N outputs, G groups, L local groups.

tokamax picks its own kernel per platform (Mosaic TPU / Mosaic GPU / Triton / XLA). Its gmm
takes the same local-window arguments as jax.lax.ragged_dot, so the window handling of the
ragged_dot backend is reused; tgmm uses XLA's ragged_dot_general, which tokamax also wraps.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import tokamax  # raises ImportError when absent; the package __init__ then skips this module
from jax import Array

from moetext.kernels.gmm.backend import GmmCall, register
from moetext.kernels.gmm.ragged_dot import RaggedDotBackend


@dataclasses.dataclass(frozen=True)
class TokamaxBackend(RaggedDotBackend):
    """tokamax.ragged_dot for gmm (tokamax picks the kernel); tgmm as ragged_dot."""

    name: ClassVar[str] = "tokamax"

    def gmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        return self._masked_gmm(tokamax.ragged_dot, lhs, rhs, group_sizes, call)


register("tokamax", TokamaxBackend)
