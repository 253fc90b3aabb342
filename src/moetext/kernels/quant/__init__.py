"""Quantization: the recipes that wrap any gmm backend (`Gmm(backend, recipe)`), and the FP8
numerics they run on.

    recipe = make_recipe("fp8_blockwise", {"block_size": 128, "qag": True})
    op = Gmm(get_backend("auto"), recipe)
    q, s = quantize(x)                                   # 1 x 128 blocks along the last axis

Files: one per recipe (`fp8_blockwise.py`, `fp8_tensorwise.py`; `none` is gmm/recipe.py's
`NoQuantization`) and `registry.py` (names -> recipes); `fp8_quantize.py` (block-wise and
per-tensor FP8 quantization, the `Quantized` operand), `fp8_reference.py` (their float64 NumPy
oracles and the FP8 grouped-matmul oracles), `qag.py` (the quantized all-gather),
`scaled_kernels.py` (fused matmuls on `Quantized` operands and which backend has them). The
FP8 Pallas kernel bodies are in `moetext.kernels.pallas`; the scale rule in
`moetext.kernels.fp8_scaling`.

Adding a recipe is adding `quant/<name>.py` with a frozen dataclass subclassing `gmm.Recipe`
(its fields are its options) and one `register_recipe` line below.
"""

from moetext.kernels.gmm.recipe import NoQuantization, Recipe
from moetext.kernels.quant.fp8_blockwise import Fp8Blockwise, Fp8Ops
from moetext.kernels.quant.fp8_quantize import (
    DualQuantized,
    Quantized,
    dequantize,
    dequantize_tiles,
    dual_quantize,
    quantize,
    quantize_tensorwise,
    quantize_tiles,
)
from moetext.kernels.quant.fp8_tensorwise import Fp8Tensorwise
from moetext.kernels.quant.qag import quantized_all_gather
from moetext.kernels.quant.registry import available_recipes, make_recipe, register_recipe
from moetext.kernels.quant.scaled_kernels import (
    ScaledKernels,
    register_scaled_kernels,
    scaled_kernels_for,
)

register_recipe(NoQuantization)
register_recipe(Fp8Blockwise)
register_recipe(Fp8Tensorwise)

__all__ = [
    "DualQuantized",
    "Fp8Blockwise",
    "Fp8Ops",
    "Fp8Tensorwise",
    "NoQuantization",
    "Quantized",
    "Recipe",
    "ScaledKernels",
    "available_recipes",
    "dequantize",
    "dequantize_tiles",
    "dual_quantize",
    "make_recipe",
    "quantize",
    "quantize_tensorwise",
    "quantize_tiles",
    "quantized_all_gather",
    "register_recipe",
    "register_scaled_kernels",
    "scaled_kernels_for",
]
