"""Dense Qwen3: the qwen3_moe decoder with every layer a SwiGLU of width mlp_dim (no router,
no experts; the moe section of the config is unused)."""

from __future__ import annotations

from moetext.config.schema import ModelConfig
from moetext.models.family import register_family
from moetext.models.qwen3_moe import LOGICAL_AXES, decoder_family


def _pattern(m: ModelConfig) -> tuple[bool, ...]:
    return (False,) * m.num_layers


FAMILY = register_family(
    decoder_family(
        "dense",
        "dense Qwen3 decoder: GQA + qk-norm, every layer a SwiGLU",
        _pattern,
        LOGICAL_AXES - {"exp", "mlp_moe"},
    )
)
