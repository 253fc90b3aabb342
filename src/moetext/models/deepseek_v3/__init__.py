"""DeepSeek-V3 (also Kimi K2, Moonlight-16B-A3B): `model.family: deepseek_v3`.

Multi-head latent attention with a latent decode cache (mla.py), DeepSeek's RoPE with YaRN
(rope.py), a dense SwiGLU prefix then MoE layers with shared experts (model.py), counted by
flops.py, converted to and from Hugging Face by hf.py (the `hf` adapter); its own `model:`
fields are config.py's. The MoE layers are the shared MoEBlock (route with moe.router:
sigmoid_topk for DeepSeek-V3's group-limited, bias-balanced gate).
"""

from __future__ import annotations

from moetext.config.schema import MoEConfig
from moetext.models.deepseek_v3 import flops
from moetext.models.deepseek_v3.config import DeepSeekModelConfig
from moetext.models.deepseek_v3.hf import HF
from moetext.models.deepseek_v3.mla import MLA, MLACache, MLAConfig
from moetext.models.deepseek_v3.model import Decoder, decode_cache
from moetext.models.deepseek_v3.rope import Yarn
from moetext.models.family import register_family, typed_family
from moetext.models.layers.decoder import STACK_AXES

__all__ = ["FAMILY", "MLA", "Decoder", "DeepSeekModelConfig", "MLACache", "MLAConfig", "Yarn"]

# The stack's axes (layers/decoder.py) and MLA's low-rank q_lora / kv_lora. No kv_heads: MLA's
# keys and values have a head per query head.
LOGICAL_AXES = STACK_AXES | {"q_lora", "kv_lora"}


FAMILY = register_family(
    typed_family(
        "deepseek_v3",
        "DeepSeek-V3 decoder: MLA + dense prefix + MoE with shared experts",
        model_config=DeepSeekModelConfig,
        moe_config=MoEConfig,
        build=lambda m, moe, k, rngs: Decoder(m, moe, k, rngs=rngs),
        moe_layers=DeepSeekModelConfig.moe_layers,
        count_params=flops.param_counts,
        flops_per_token=flops.flops_per_token,
        logical_axes=LOGICAL_AXES,
        decode_cache=decode_cache,
        hf=HF,
    )
)
