"""Qwen3-MoE (and Qwen3 dense layers): the decoder of model.py, counted by flops.py, converted
by hf.py. Two registered families share it:

- qwen3_moe: layer i holds the MoE block when (i + 1) % decoder_sparse_step == 0 and i is not in
  mlp_only_layers (the Hugging Face Qwen3-MoE rule); the others hold a SwiGLU of width mlp_dim;
- dense: the same decoder with every layer a SwiGLU of width mlp_dim (no router, no experts;
  the moe section of the config is unused).
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from moetext.config.schema import KernelsConfig
from moetext.models.family import ModelFamily, register_family, typed_family
from moetext.models.hf import HfAdapter
from moetext.models.layers.decoder import STACK_AXES
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig
from moetext.models.qwen3_moe.flops import decoder_flops_per_token, decoder_param_counts
from moetext.models.qwen3_moe.hf import HF
from moetext.models.qwen3_moe.model import Decoder, decode_cache, moe_layer_pattern

# The stack's axes (layers/decoder.py) and GQA's kv_heads.
LOGICAL_AXES = STACK_AXES | {"kv_heads"}


def decoder_family(
    name: str,
    description: str,
    pattern: Callable[[QwenModelConfig], tuple[bool, ...]],
    logical_axes: frozenset[str],
    hf: HfAdapter | None = None,
) -> ModelFamily:
    """The Qwen3 Decoder as a family whose MoE layers `pattern` picks (qwen3_moe, dense):
    module tree, counts and layer restacking all follow the one pattern."""

    def build(m: QwenModelConfig, moe: QwenMoEConfig, k: KernelsConfig, rngs: nnx.Rngs) -> Decoder:
        return Decoder(m, moe, k, moe_pattern=pattern(m), rngs=rngs)

    return typed_family(
        name,
        description,
        model_config=QwenModelConfig,
        moe_config=QwenMoEConfig,
        build=build,
        moe_layers=pattern,
        count_params=lambda m, moe: decoder_param_counts(m, moe, pattern(m)),
        flops_per_token=lambda m, moe, s: decoder_flops_per_token(m, moe, s, pattern(m)),
        logical_axes=logical_axes,
        decode_cache=decode_cache,
        hf=hf,
    )


FAMILY = register_family(
    decoder_family(
        "qwen3_moe",
        "Qwen3-MoE decoder: GQA + qk-norm, MoE every decoder_sparse_step layers",
        moe_layer_pattern,
        LOGICAL_AXES,
        hf=HF,
    )
)


def _dense_pattern(m: QwenModelConfig) -> tuple[bool, ...]:
    return (False,) * m.num_layers


DENSE = register_family(
    decoder_family(
        "dense",
        "dense Qwen3 decoder: GQA + qk-norm, every layer a SwiGLU",
        _dense_pattern,
        LOGICAL_AXES - {"exp", "mlp_moe"},
    )
)
