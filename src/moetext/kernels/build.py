"""`build_gmm`: the one `Gmm` a model's MoE layers share, from names (what a config holds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.gmm.api import Gmm
from moetext.kernels.gmm.backend import GmmBackend, TilingArg, get_backend
from moetext.kernels.quant.registry import make_recipe


def build_gmm(
    backend: str | GmmBackend = "auto",
    quantization: str = "none",
    recipe_options: Mapping[str, Any] | None = None,
    *,
    tiling: TilingArg = None,
    checked: bool = False,
    grad_reduce_dtype: DTypeLike | None = None,
    fuse_gate_up: bool | Literal["auto"] = "auto",
    regather_weights: bool = False,
) -> Gmm:
    """Gmm(get_backend(backend), make_recipe(quantization, recipe_options), ...).

    fuse_gate_up "auto" fuses exactly when the recipe quantizes (the shared input is then
    quantized and kept once). Unknown names and options are ValueErrors naming the nearest valid
    one; nothing here traces, so a bad setting fails before anything compiles.
    """
    recipe = make_recipe(quantization, recipe_options)
    fuse = recipe.quantizes if fuse_gate_up == "auto" else bool(fuse_gate_up)
    return Gmm(
        get_backend(backend),
        recipe,
        tiling=tiling,
        checked=checked,
        grad_reduce_dtype=None if grad_reduce_dtype is None else jnp.dtype(grad_reduce_dtype).name,
        fuse_gate_up=fuse,
        regather_weights=regather_weights,
    )
