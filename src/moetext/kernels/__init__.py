"""MoE kernels. Imports jax (and optional extras) only; never models/ or config/.

    gmm   = build_gmm("auto", "fp8_blockwise", {"qag": True})   # what a layer receives
    y     = gmm(x, w, group_sizes)

Subpackages, each importing only those before it: `pallas` (Pallas TPU kernel bodies and
tilings), `gmm` (the GmmBackend and Recipe protocols, the GmmCall spec, the Gmm op, backends),
`quant` (quantization recipes, one file each, and the FP8 numerics they run on). Modules:
`typed_jax` (annotated jax entry points), `fp8_scaling` (the FP8 scale rule every quantizer
shares), `activations` (SwiGLU), `build` (`build_gmm`), `host_dots` (whether a CPU matmul
widens bfloat16 operands: CPUs without bfloat16 dot instructions).
"""

from moetext.kernels.build import build_gmm
from moetext.kernels.gmm import Gmm, GmmBackend, GmmCall, Recipe, get_backend
from moetext.kernels.quant import available_recipes, make_recipe

__all__ = [
    "Gmm",
    "GmmBackend",
    "GmmCall",
    "Recipe",
    "available_recipes",
    "build_gmm",
    "get_backend",
    "make_recipe",
]
