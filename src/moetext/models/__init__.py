"""Flax NNX models. `build(model_cfg, moe_cfg, kernels_cfg, rngs=nnx.Rngs(params=seed))`."""

from moetext.models.decoder import Decoder, DecoderLayer, moe_layer_pattern
from moetext.models.registry import available_families, build, register_family

__all__ = [
    "Decoder",
    "DecoderLayer",
    "available_families",
    "build",
    "moe_layer_pattern",
    "register_family",
]
