"""Qwen3(-MoE) parameter counts and training FLOPs per token (convention: models/flops.py).

Every count follows the module tree of qwen3_moe/model.py for a given MoE layer pattern, so the
dense family (the same tree with no MoE layer) shares it.
"""

from __future__ import annotations

from collections.abc import Sequence

from moetext.models.family import ParamCounts
from moetext.models.flops import dot_product_attention_flops, six_n_plus_attention
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig


def decoder_param_counts(
    c: QwenModelConfig, moe: QwenMoEConfig, pattern: Sequence[bool]
) -> ParamCounts:
    """Counts of the Decoder with `pattern[i]` True where layer i is an MoE layer."""
    d, n, kv, h = c.emb_dim, c.num_heads, c.num_kv_heads, c.head_dim
    attn = d * n * h + 2 * d * kv * h + n * h * d + (2 * h if c.qk_norm else 0)
    attn += (n + 2 * kv) * h if c.attention_bias else 0
    per_layer_common = attn + 2 * d  # attention + the two pre-norms
    dense_mlp = 3 * d * c.mlp_dim
    expert = 3 * d * moe.moe_intermediate_size
    shared_width = moe.num_shared_experts * (
        moe.shared_intermediate_size or moe.moe_intermediate_size
    )
    moe_common = d * moe.num_experts + 3 * d * shared_width  # router + shared experts
    moe_common += d if moe.shared_expert_gate else 0
    n_moe = sum(bool(m) for m in pattern)
    n_dense = c.num_layers - n_moe
    embedding = c.vocab_size * d
    head = 0 if c.tie_embeddings else d * c.vocab_size
    outer = embedding + head + d  # + final norm
    layers_total = c.num_layers * per_layer_common + n_dense * dense_mlp
    layers_total += n_moe * (moe_common + moe.num_experts * expert)
    inactive = n_moe * (moe.num_experts - moe.num_experts_per_tok) * expert
    total = outer + layers_total
    return {"total": total, "active": total - inactive, "embedding": embedding}


def decoder_flops_per_token(
    c: QwenModelConfig, moe: QwenMoEConfig, seq_len: int, pattern: Sequence[bool]
) -> float:
    counts = decoder_param_counts(c, moe, pattern)
    attention = dot_product_attention_flops(c.num_layers, c.num_heads, c.head_dim, seq_len)
    return six_n_plus_attention(counts, c, attention)
