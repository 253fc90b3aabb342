"""Flax NNX models, one folder per family (models/family.py says what a family provides).

    model = models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=seed))

layers/ and moe/ are the building blocks families share.
"""

from moetext.models.family import (
    CausalLM,
    HiddenStatesLM,
    ModelFamily,
    ModelStateLM,
    ParamCounts,
    available_families,
    build,
    get_family,
    register_family,
)
from moetext.models.layers.params import ModelState

# The built-in families: each registers itself on import (one line per family).
from moetext.models import dense, qwen3_moe  # noqa: E402, F401  isort: skip

__all__ = [
    "CausalLM",
    "HiddenStatesLM",
    "ModelFamily",
    "ModelState",
    "ModelStateLM",
    "ParamCounts",
    "available_families",
    "build",
    "get_family",
    "register_family",
]
