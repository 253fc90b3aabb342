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

from moetext.config.families import as_family_class
from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.family import ModelFamily, ParamCounts, register_family
from moetext.models.hf import HfAdapter
from moetext.models.layers.scan import stack_layers, stacked_path, unstack_layers
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig, qwen_sections
from moetext.models.qwen3_moe.flops import decoder_flops_per_token, decoder_param_counts
from moetext.models.qwen3_moe.hf import HF
from moetext.models.qwen3_moe.model import Decoder, decode_cache, moe_layer_pattern

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


def decoder_family(
    name: str,
    description: str,
    pattern: Callable[[QwenModelConfig], tuple[bool, ...]],
    logical_axes: frozenset[str],
    hf: HfAdapter | None = None,
) -> ModelFamily:
    """The Qwen3 Decoder as a family whose MoE layers `pattern` picks (qwen3_moe, dense):
    module tree, counts and layer restacking all follow the one pattern."""

    def build(m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs) -> Decoder:
        qm, qmoe = qwen_sections(m, moe)
        return Decoder(qm, qmoe, k, moe_pattern=pattern(qm), rngs=rngs)

    def count(m: ModelConfig, moe: MoEConfig) -> ParamCounts:
        qm, qmoe = qwen_sections(m, moe)
        return decoder_param_counts(qm, qmoe, pattern(qm))

    def flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
        qm, qmoe = qwen_sections(m, moe)
        return decoder_flops_per_token(qm, qmoe, seq_len, pattern(qm))

    def layers(m: ModelConfig) -> tuple[bool, ...]:
        return pattern(as_family_class(m, QwenModelConfig, "model", m.family))

    return ModelFamily(
        name=name,
        description=description,
        build=build,
        moe_layers=layers,
        count_params=count,
        flops_per_token=flops,
        logical_axes=logical_axes,
        stack_layers=lambda p, m: stack_layers(p, layers(m)),
        unstack_layers=lambda p, m: unstack_layers(p, layers(m)),
        stacked_path=lambda m, path: stacked_path(path, layers(m)),
        model_config=QwenModelConfig,
        moe_config=QwenMoEConfig,
        hf=hf,
        decode_cache=decode_cache,
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
