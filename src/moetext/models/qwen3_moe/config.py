"""The Qwen decoders' own config fields, written flat under `model:` and `moe:` in YAML beside
the shared ones (config/families.py): the layer pattern, q/k norm and bias, the gated shared
expert. The qwen3_moe and dense families read these classes."""

from __future__ import annotations

from dataclasses import dataclass

from moetext.config.families import as_family_class
from moetext.config.fields import shapes_params
from moetext.config.schema import ModelConfig, MoEConfig
from moetext.errors import ConfigError


@dataclass(frozen=True)
class QwenModelConfig(ModelConfig):
    qk_norm: bool = shapes_params(True)
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    attention_bias: bool = shapes_params(False)
    """Bias on the q, k and v projections (Qwen2, Qwen2-MoE)."""
    decoder_sparse_step: int = shapes_params(1)
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = shapes_params(())
    """Indices of layers that use the dense MLP even when decoder_sparse_step selects MoE."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decoder_sparse_step <= 0:
            raise ConfigError(
                f"model.decoder_sparse_step must be positive, got {self.decoder_sparse_step}"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model.mlp_only_layers {bad} out of range [0, {self.num_layers})")


@dataclass(frozen=True)
class QwenMoEConfig(MoEConfig):
    shared_expert_gate: bool = shapes_params(False)
    """Scale the shared experts' output per token by sigmoid(x @ w [D, 1]) (Qwen2-MoE)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_expert_gate and self.num_shared_experts < 1:
            raise ConfigError(
                "moe.shared_expert_gate=true gates the shared experts: it needs "
                f"moe.num_shared_experts >= 1, got {self.num_shared_experts}"
            )


def qwen_sections(m: ModelConfig, moe: MoEConfig) -> tuple[QwenModelConfig, QwenMoEConfig]:
    """The sections as the Qwen classes (base-class sections built in code get the Qwen fields
    at their defaults)."""
    return (
        as_family_class(m, QwenModelConfig, "model", m.family),
        as_family_class(moe, QwenMoEConfig, "moe", m.family),
    )
