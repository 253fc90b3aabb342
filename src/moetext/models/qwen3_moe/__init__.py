"""Qwen3-MoE (and Qwen3 dense layers): the decoder of model.py, counted by flops.py.

Layer i holds the MoE block when (i + 1) % decoder_sparse_step == 0 and i is not in
mlp_only_layers (the Hugging Face Qwen3-MoE rule); the others hold a SwiGLU of width mlp_dim.
"""

from __future__ import annotations

from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.family import ModelFamily, ParamCounts, register_family
from moetext.models.qwen3_moe.flops import decoder_flops_per_token, decoder_param_counts
from moetext.models.qwen3_moe.model import (
    Decoder,
    moe_layer_pattern,
    stack_layers,
    unstack_layers,
)

# Params: embedding/head, attention, norms, dense MLP, router, experts; "layers" is the stacked
# axis of scan_layers; activations: batch, length, embed, vocab (logits).
LOGICAL_AXES = frozenset(
    {
        "batch",
        "length",
        "embed",
        "vocab",
        "heads",
        "kv_heads",
        "head_dim",
        "mlp",
        "exp",
        "mlp_moe",
        "norm",
        "layers",
    }
)


def _build(m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(m, moe, k, moe_pattern=moe_layer_pattern(m), rngs=rngs)


def _count(m: ModelConfig, moe: MoEConfig) -> ParamCounts:
    return decoder_param_counts(m, moe, moe_layer_pattern(m))


def _flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    return decoder_flops_per_token(m, moe, seq_len, moe_layer_pattern(m))


FAMILY = register_family(
    ModelFamily(
        name="qwen3_moe",
        description="Qwen3-MoE decoder: GQA + qk-norm, MoE every decoder_sparse_step layers",
        build=_build,
        moe_layers=moe_layer_pattern,
        count_params=_count,
        flops_per_token=_flops,
        logical_axes=LOGICAL_AXES,
        stack_layers=lambda p, m: stack_layers(p, moe_layer_pattern(m)),
        unstack_layers=lambda p, m: unstack_layers(p, moe_layer_pattern(m)),
    )
)
