"""DeepSeek-V3 (also Kimi K2, Moonlight-16B-A3B): `model.family: deepseek_v3`.

Multi-head latent attention with a latent decode cache (mla.py), DeepSeek's RoPE with YaRN
(rope.py), a dense SwiGLU prefix then MoE layers with shared experts (model.py), counted by
flops.py, converted to and from Hugging Face by hf.py (the `hf` adapter); its own `model:`
fields are config.py's. The MoE layers are the shared MoEBlock (route with moe.router:
sigmoid_topk for DeepSeek-V3's group-limited, bias-balanced gate).
"""

from __future__ import annotations

from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig, MoEConfig
from moetext.models.deepseek_v3 import flops
from moetext.models.deepseek_v3.config import DeepSeekModelConfig, deepseek_model
from moetext.models.deepseek_v3.hf import HF
from moetext.models.deepseek_v3.mla import MLA, MLACache, MLAConfig
from moetext.models.deepseek_v3.model import Decoder, decode_cache
from moetext.models.deepseek_v3.rope import Yarn
from moetext.models.family import ModelFamily, ParamCounts, register_family
from moetext.models.layers.scan import stack_layers, stacked_path, unstack_layers

__all__ = ["FAMILY", "MLA", "Decoder", "DeepSeekModelConfig", "MLACache", "MLAConfig", "Yarn"]

# Params: embedding/head, MLA (heads, head_dim, the low-rank q_lora / kv_lora), norms, dense
# MLP, router, experts; "layers" is scan_layers' stacked axis; activations: batch, length,
# embed, vocab (logits). No kv_heads: MLA's keys and values have a head per query head.
LOGICAL_AXES = frozenset(
    {
        "batch",
        "length",
        "embed",
        "vocab",
        "heads",
        "head_dim",
        "q_lora",
        "kv_lora",
        "mlp",
        "exp",
        "mlp_moe",
        "norm",
        "layers",
    }
)


def _build(m: ModelConfig, moe: MoEConfig, k: KernelsConfig, rngs: nnx.Rngs) -> Decoder:
    return Decoder(deepseek_model(m), moe, k, rngs=rngs)


def _layers(m: ModelConfig) -> tuple[bool, ...]:
    return deepseek_model(m).moe_layers()


def _count(m: ModelConfig, moe: MoEConfig) -> ParamCounts:
    return flops.param_counts(deepseek_model(m), moe)


def _flops(m: ModelConfig, moe: MoEConfig, seq_len: int) -> float:
    return flops.flops_per_token(deepseek_model(m), moe, seq_len)


FAMILY = register_family(
    ModelFamily(
        name="deepseek_v3",
        description="DeepSeek-V3 decoder: MLA + dense prefix + MoE with shared experts",
        build=_build,
        moe_layers=_layers,
        count_params=_count,
        flops_per_token=_flops,
        logical_axes=LOGICAL_AXES,
        stack_layers=lambda p, m: stack_layers(p, _layers(m)),
        unstack_layers=lambda p, m: unstack_layers(p, _layers(m)),
        stacked_path=lambda m, path: stacked_path(path, _layers(m)),
        model_config=DeepSeekModelConfig,
        moe_config=MoEConfig,
        decode_cache=lambda m, b, n: decode_cache(deepseek_model(m), b, n),
        hf=HF,
    )
)
