"""Grouped matmul (GMM) and its transposed twin (TGMM) behind one backend protocol.

    out = gmm(lhs, rhs, group_sizes, backend="auto")      # [M,K] x [G,K,N] -> [M,N]
    dw  = tgmm(lhs, dout, group_sizes)                     # [M,K] x [M,N]   -> [G,K,N]
"""

from moetext.kernels.gmm import ragged_dot  # noqa: F401  (registers the backend)
from moetext.kernels.gmm.api import gmm, local_row_mask, tgmm
from moetext.kernels.gmm.backend import (
    GmmBackend,
    auto_backend_name,
    available_backends,
    get_backend,
    register,
)

__all__ = [
    "GmmBackend", "auto_backend_name", "available_backends", "get_backend", "gmm",
    "local_row_mask", "register", "tgmm",
]
