"""Grouped matmul (GMM) and its transposed twin (TGMM) behind one backend protocol.

    op  = Gmm(get_backend("auto"))                    # backend + recipe + shared options
    out = op(lhs, rhs, group_sizes)                   # [M,K] x [G,K,N] -> [M,N]
    dw  = op.tgmm(lhs, dout, group_sizes)             # [M,K] x [M,N]   -> [G,K,N]
    out = gmm(lhs, rhs, group_sizes, backend="auto")  # the same, one call

Two declared seams: `GmmBackend` (backend.py: forward math) and `Recipe` (recipe.py:
quantization and autodiff around any backend; the quantized recipes are in
`moetext.kernels.quant`). Both take the per-call options as one `GmmCall` (backend.py). The
Pallas kernel bodies the pallas_tpu backend runs are in `moetext.kernels.pallas`.

Importing this package registers every backend whose dependencies import: reference,
ragged_dot, blocked always; tokamax when installed; pallas_tpu when its module is present.
"""

import importlib as _importlib

from moetext.kernels.gmm import blocked, ragged_dot, reference  # noqa: F401  (register)
from moetext.kernels.gmm.api import Gmm, gmm, local_row_mask, tgmm
from moetext.kernels.gmm.backend import (
    GmmBackend,
    GmmCall,
    Tiling,
    auto_backend_name,
    available_backends,
    get_backend,
    register,
)
from moetext.kernels.gmm.gather import Gather, WeightGather, all_gather_dims, psum_scatter_dims
from moetext.kernels.gmm.recipe import NoQuantization, Recipe
from moetext.kernels.gmm.reference import gmm_reference, tgmm_reference

for _optional in ("tokamax_backend", "pallas_tpu"):
    try:  # optional backends: a missing extra (tokamax) or a missing module is not an error
        _importlib.import_module(f"moetext.kernels.gmm.{_optional}")
    except ImportError as _err:
        if _err.name not in (f"moetext.kernels.gmm.{_optional}", "tokamax"):
            raise

__all__ = [
    "Gather",
    "Gmm",
    "GmmBackend",
    "GmmCall",
    "NoQuantization",
    "Recipe",
    "Tiling",
    "WeightGather",
    "all_gather_dims",
    "auto_backend_name",
    "available_backends",
    "get_backend",
    "gmm",
    "gmm_reference",
    "local_row_mask",
    "psum_scatter_dims",
    "register",
    "tgmm",
    "tgmm_reference",
]
