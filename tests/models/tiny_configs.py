"""Tiny model configs shared by the model tests (one set of shapes keeps compiles cached)."""

import dataclasses

from moetext.config.schema import KernelsConfig
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
