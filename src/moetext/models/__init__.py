"""Flax NNX models, one folder per family (models/family.py says what a family provides).

    model = models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=seed))

layers/ and moe/ are the building blocks families share.
"""

from moetext.models.family import (
    EXTRA_LOSS_KEY,
    CacheArray,
    CausalLM,
    HiddenStatesLM,
    LossTargets,
    ModelFamily,
    ModelStateLM,
    ParamCounts,
    TargetsLM,
    added_loss,
    available_families,
    build,
    check_names,
    family_for_hf,
    get_family,
    hf_adapter,
    is_cache_array,
    register_family,
    zeros_cache,
)
from moetext.models.layers.params import ModelState

# The built-in families: each registers itself on import (one line per family).
from moetext.models import qwen3_moe  # noqa: E402, F401  isort: skip
from moetext.models import deepseek_v3  # noqa: E402, F401  isort: skip

__all__ = [
    "EXTRA_LOSS_KEY",
    "CacheArray",
    "CausalLM",
    "HiddenStatesLM",
    "LossTargets",
    "ModelFamily",
    "ModelState",
    "ModelStateLM",
    "ParamCounts",
    "TargetsLM",
    "added_loss",
    "available_families",
    "build",
    "check_names",
    "family_for_hf",
    "get_family",
    "hf_adapter",
    "is_cache_array",
    "register_family",
    "zeros_cache",
]
