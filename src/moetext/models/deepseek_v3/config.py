"""The DeepSeek-V3 family's own `model:` fields, written flat beside the shared ones
(config/families.py): multi-head latent attention (MLA) dims, DeepSeek's RoPE (interleaved pairs,
YaRN), the dense prefix of the layer stack and multi-token prediction (MTP).

The routing fields DeepSeek-V3 uses (router: sigmoid_topk, n_group, topk_group,
routed_scaling_factor, norm_topk_prob, bias_update_rate, num_shared_experts) are shared `moe:`
fields, so the family's `moe:` section is the shared MoEConfig. Of the shared `model:` fields
MLA does not read num_kv_heads or head_dim (its head dims are the fields below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetext.config.families import as_family_class
from moetext.config.fields import must_match, resume_safe, shapes_params
from moetext.config.schema import ModelConfig
from moetext.errors import ConfigError
from moetext.models.deepseek_v3.rope import Yarn


@dataclass(frozen=True)
class DeepSeekModelConfig(ModelConfig):
    q_lora_rank: int | None = shapes_params(None)
    """Rank of the query's low-rank path (q_a -> RMSNorm -> q_b; DeepSeek-V3: 1536); null: one
    plain query projection (Moonlight-16B-A3B)."""
    kv_lora_rank: int = shapes_params(64)
    """Width of the compressed key/value latent, what decoding caches (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int = shapes_params(32)
    """Per-head query/key dims without RoPE (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int = shapes_params(16)
    """Query/key dims with RoPE; the key's are one head shared by all heads (DeepSeek-V3: 64)."""
    v_head_dim: int = shapes_params(32)
    """Per-head value dims (DeepSeek-V3: 128)."""
    first_k_dense_replace: int = shapes_params(1)
    """The first this many layers use the dense SwiGLU (width mlp_dim); the rest are MoE."""
    rope_interleave: bool = must_match(True)
    """Rotate interleaved pairs (x0, x1), (x2, x3)... as released DeepSeek checkpoints store
    q/k; false: rotate halves (x_i, x_{i+R/2})."""
    yarn_factor: float | None = must_match(None)
    """YaRN context-extension factor (DeepSeek-V3: 40); null: plain RoPE."""
    yarn_original_max_position_embeddings: int = must_match(4096)
    """The context length the RoPE frequencies were trained at (YaRN only)."""
    yarn_beta_fast: float = must_match(32.0)
    """YaRN: dims turning more often than this over the original context keep their frequency."""
    yarn_beta_slow: float = must_match(1.0)
    """YaRN: dims turning less often than this are divided by the factor; a ramp in between."""
    yarn_mscale: float = must_match(1.0)
    """YaRN mscale of cos/sin (HF rope_scaling.mscale)."""
    yarn_mscale_all_dim: float = must_match(0.0)
    """YaRN mscale folded, squared, into the softmax scale (HF rope_scaling.mscale_all_dim;
    DeepSeek-V3: 1.0); 0: unset."""
    mtp_layers: int = shapes_params(0)
    """Multi-token prediction modules (HF num_nextn_predict_layers; DeepSeek-V3: 1): depth k
    predicts token i + k + 1 from position i; 0: none."""
    mtp_loss_weight: float = resume_safe(0.3)
    """lambda: the total loss adds lambda x mtp_loss (the mean over MTP depths) (DeepSeek-V3:
    0.3 for its first 10T tokens, then 0.1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_mla_dims("model", self, MLA_DIMS)
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ConfigError(
                f"model.first_k_dense_replace={self.first_k_dense_replace} must be in "
                f"[0, model.num_layers={self.num_layers}]"
            )
        if self.mtp_layers < 0:
            raise ConfigError(f"model.mtp_layers must be >= 0, got {self.mtp_layers}")
        if self.mtp_loss_weight < 0:
            raise ConfigError(f"model.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        try:
            _ = self.yarn  # Yarn checks its own fields
        except ValueError as e:
            raise ConfigError(f"model.yarn_*: {e}") from None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> Yarn | None:
        """The YaRN scaling these fields describe; None without yarn_factor."""
        if self.yarn_factor is None:
            return None
        return Yarn(
            factor=self.yarn_factor,
            original_max_position_embeddings=self.yarn_original_max_position_embeddings,
            beta_fast=self.yarn_beta_fast,
            beta_slow=self.yarn_beta_slow,
            mscale=self.yarn_mscale,
            mscale_all_dim=self.yarn_mscale_all_dim,
        )

    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, True where it holds the MoE block (all but the dense prefix)."""
        return tuple(i >= self.first_k_dense_replace for i in range(self.num_layers))


def deepseek_model(m: ModelConfig) -> DeepSeekModelConfig:
    """The section as DeepSeekModelConfig (a base-class section built in code gets the DeepSeek
    fields at their defaults)."""
    return as_family_class(m, DeepSeekModelConfig, "model", m.family)


# The model fields that size MLA (q_lora_rank None: a plain query projection).
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla_dims(section: str, cfg: Any, names: tuple[str, ...]) -> None:
    """Multi-head latent attention's dimensions, cfg's fields `names` (deepseek_v3/mla.py): each
    positive (q_lora_rank may be None: a plain query projection), qk_rope_head_dim even (RoPE
    rotates pairs); a ConfigError naming `section`.field and its value otherwise."""
    for name in names:
        value = getattr(cfg, name)
        if value is None and name == "q_lora_rank":
            continue
        if value <= 0:
            raise ConfigError(
                f"{section}.{name} must be positive, got {value}"
                + (" (null: a plain query projection)" if name == "q_lora_rank" else "")
            )
    rope_dim = cfg.qk_rope_head_dim
    if rope_dim % 2:
        raise ConfigError(f"{section}.qk_rope_head_dim must be even for RoPE, got {rope_dim}")
