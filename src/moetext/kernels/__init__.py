"""MoE kernels. Imports jax (and optional extras) only; never models/ or config/.

    gmm   = build_gmm("auto", "fp8_blockwise", {"qag": True})   # what a layer receives
    y     = gmm(x, w, group_sizes)

Subpackages: `gmm` (the GmmBackend and Recipe protocols, the Gmm op, backends), `quant`
(quantization recipes, one file each), `fp8` (FP8 quantization, FP8 Pallas kernels, QAG).
"""

from moetext.kernels.build import build_gmm
from moetext.kernels.gmm import Gmm, GmmBackend, Recipe, get_backend
from moetext.kernels.quant import available_recipes, make_recipe

__all__ = [
    "Gmm",
    "GmmBackend",
    "Recipe",
    "available_recipes",
    "build_gmm",
    "get_backend",
    "make_recipe",
]
