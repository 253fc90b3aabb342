"""Analytic parameter counts and training FLOPs per token, from the config alone.

Conventions (PaLM appendix B / MaxText): training FLOPs per token =
6 * N_active_nonembedding + 12 * num_layers * num_heads * head_dim * seq_len.
- N_active_nonembedding counts every parameter a token's matmuls touch: attention, dense MLPs,
  the router, K of the E routed experts, shared experts, norms, and the LM head (D * V, also
  when tied to the embedding); the embedding lookup itself is a gather and costs no FLOPs.
- The attention term is the full (non-causal) QK^T and AV cost; it is not halved for the causal
  mask, matching the PaLM/MaxText convention so MFU numbers compare across codebases.
"""

from __future__ import annotations

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.models import registry
from moetext.models.decoder import moe_layer_pattern


def _pattern(cfg: ModelConfig) -> tuple[bool, ...]:
    if cfg.family not in registry.available_families():
        raise ValueError(
            f"unknown model family {cfg.family!r}; valid names: "
            f"{', '.join(registry.available_families())}"
        )
    return (False,) * cfg.num_layers if cfg.family == "dense" else moe_layer_pattern(cfg)


def count_params(model_cfg: ModelConfig, moe_cfg: MoEConfig) -> dict[str, int]:
    """{"total", "active", "embedding"}: all params, params used per token, embedding table.

    With tie_embeddings the table is counted once (it is also the LM head).
    """
    c = model_cfg
    d, n, kv, h = c.emb_dim, c.num_heads, c.num_kv_heads, c.head_dim
    attn = d * n * h + 2 * d * kv * h + n * h * d + (2 * h if c.qk_norm else 0)
    per_layer_common = attn + 2 * d  # attention + the two pre-norms
    dense_mlp = 3 * d * c.mlp_dim
    expert = 3 * d * moe_cfg.moe_intermediate_size
    shared_width = moe_cfg.num_shared_experts * (
        moe_cfg.shared_intermediate_size or moe_cfg.moe_intermediate_size
    )
    moe_common = d * moe_cfg.num_experts + 3 * d * shared_width  # router + shared experts
    pattern = _pattern(c)
    n_moe = sum(pattern)
    n_dense = c.num_layers - n_moe
    embedding = c.vocab_size * d
    head = 0 if c.tie_embeddings else d * c.vocab_size
    outer = embedding + head + d  # + final norm
    layers_total = c.num_layers * per_layer_common + n_dense * dense_mlp
    layers_total += n_moe * (moe_common + moe_cfg.num_experts * expert)
    inactive = n_moe * (moe_cfg.num_experts - moe_cfg.num_experts_per_tok) * expert
    total = outer + layers_total
    return {"total": total, "active": total - inactive, "embedding": embedding}


def flops_per_token(model_cfg: ModelConfig, moe_cfg: MoEConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    counts = count_params(model_cfg, moe_cfg)
    lm_head = model_cfg.emb_dim * model_cfg.vocab_size
    # Drop the gathered table, keep the head matmul (already in "active" unless tied).
    active_nonembedding = counts["active"] - counts["embedding"]
    if model_cfg.tie_embeddings:
        active_nonembedding += lm_head
    c = model_cfg
    attention = 12 * c.num_layers * c.num_heads * c.head_dim * seq_len
    return float(6 * active_nonembedding + attention)
