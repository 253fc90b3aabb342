"""Tiny model configs shared by the model tests (one set of shapes keeps compiles cached)."""

import dataclasses

from moetext.config.schema import KernelsConfig, MoEConfig
from moetext.models.deepseek_v3.config import DeepSeekModelConfig
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig

# float32 compute so comparisons against oracles and between code paths can be tight.
TINY_MODEL = QwenModelConfig(
    family="qwen3_moe",
    vocab_size=128,
    emb_dim=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    rope_theta=10_000.0,
    dtype="float32",
    init_std=0.1,
    mlp_only_layers=(0,),  # layers: dense, MoE, MoE -> a heterogeneous stack for scan
)
TINY_MOE = QwenMoEConfig(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    aux_loss_weight=0.01,
    z_loss_weight=0.001,
)
KERNELS = KernelsConfig()


def tiny(**model_changes) -> QwenModelConfig:
    return dataclasses.replace(TINY_MODEL, **model_changes)


def tiny_moe(**moe_changes) -> QwenMoEConfig:
    return dataclasses.replace(TINY_MOE, **moe_changes)


# DeepSeek-V3 features on: q_lora, YaRN with an attention factor != 1, interleaved RoPE, a dense
# first layer, group-limited sigmoid routing (4 groups of 2, best 2) with a shared expert.
TINY_DEEPSEEK = DeepSeekModelConfig(
    family="deepseek_v3",
    vocab_size=128,
    emb_dim=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=4,  # unused by MLA
    mlp_dim=64,
    rope_theta=10_000.0,
    dtype="float32",
    init_std=0.1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    first_k_dense_replace=1,  # layers: dense, MoE, MoE
    yarn_factor=4.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.5,
)
TINY_DEEPSEEK_MOE = MoEConfig(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router="sigmoid_topk",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    num_shared_experts=1,
    aux_loss_weight=0.0,
    bias_update_rate=0.01,
)


def tiny_deepseek(**model_changes) -> DeepSeekModelConfig:
    return dataclasses.replace(TINY_DEEPSEEK, **model_changes)
