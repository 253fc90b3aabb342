"""Analytic parameter counts and training FLOPs per token, from the config alone.

`count_params` and `flops_per_token` dispatch to `model.family` (each family counts its own
module tree); the convention they share is here.

Convention (PaLM appendix B / MaxText): training FLOPs per token =
6 * N_active_nonembedding + 12 * num_layers * num_heads * head_dim * seq_len.
- N_active_nonembedding counts every parameter a token's matmuls touch: attention, dense MLPs,
  the router, K of the E routed experts, shared experts, norms, and the LM head (D * V, also
  when tied to the embedding); the embedding lookup itself is a gather and costs no FLOPs.
- The attention term is the full (non-causal) QK^T and AV cost; it is not halved for the causal
  mask, matching the PaLM/MaxText convention so MFU numbers compare across codebases.
"""

from __future__ import annotations

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.models.family import ParamCounts, get_family


def count_params(model_cfg: ModelConfig, moe_cfg: MoEConfig) -> ParamCounts:
    """{"total", "active", "embedding"} of `model_cfg.family` (a tied table counted once)."""
    return get_family(model_cfg.family).count_params(model_cfg, moe_cfg)


def flops_per_token(model_cfg: ModelConfig, moe_cfg: MoEConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token of `model_cfg.family` at `seq_len`."""
    return get_family(model_cfg.family).flops_per_token(model_cfg, moe_cfg, seq_len)


def six_n_plus_attention(
    counts: ParamCounts, model_cfg: ModelConfig, attention_flops_per_token: float
) -> float:
    """6 * N_active_nonembedding + the attention term, for a model whose LM head is a
    [V, emb_dim] matmul (counted also when tied: the table is then in "embedding")."""
    active_nonembedding = counts["active"] - counts["embedding"]
    if model_cfg.tie_embeddings:
        active_nonembedding += model_cfg.emb_dim * model_cfg.vocab_size
    return float(6 * active_nonembedding + attention_flops_per_token)


def dot_product_attention_flops(
    num_layers: int, num_heads: int, head_dim: int, seq_len: int
) -> float:
    """12 * L * N * H * S: QK^T and AV, forward and backward, full (non-causal) square."""
    return float(12 * num_layers * num_heads * head_dim * seq_len)
