"""Quantization recipes: each wraps any gmm backend (`Gmm(backend, recipe)`), one file each.

    recipe = make_recipe("fp8_blockwise", {"block_size": 128, "qag": True})
    op = Gmm(get_backend("auto"), recipe)

Adding a recipe is adding `quant/<name>.py` with a frozen dataclass subclassing `gmm.Recipe`
(its fields are its options) and one `register_recipe` line below.
"""

from moetext.kernels.gmm.recipe import NoQuantization, Recipe
from moetext.kernels.quant.fp8_blockwise import Fp8Blockwise, Fp8Ops
from moetext.kernels.quant.fp8_tensorwise import Fp8Tensorwise
from moetext.kernels.quant.registry import available_recipes, make_recipe, register_recipe

register_recipe(NoQuantization)
register_recipe(Fp8Blockwise)
register_recipe(Fp8Tensorwise)

__all__ = [
    "Fp8Blockwise",
    "Fp8Ops",
    "Fp8Tensorwise",
    "NoQuantization",
    "Recipe",
    "available_recipes",
    "make_recipe",
    "register_recipe",
]
