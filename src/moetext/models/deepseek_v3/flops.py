"""DeepSeek-V3 parameter counts and training FLOPs per token (convention: models/flops.py).

The counts follow model.py's module tree: per layer two RMSNorms, MLA (q_a, q_a_norm, q_b or a
plain q; kv_a, kv_a_norm, kv_b; o), then a SwiGLU of width mlp_dim (the first
first_k_dense_replace layers) or the MoE block (router, shared experts, routed experts). The
routers' selection bias is model state, not a parameter, and is not counted.
"""

from __future__ import annotations

from moetext.config.schema import MoEConfig
from moetext.models.deepseek_v3.config import DeepSeekModelConfig
from moetext.models.family import ParamCounts
from moetext.models.flops import six_n_plus_attention


def mla_params(c: DeepSeekModelConfig) -> int:
    """One MLA layer's parameters."""
    d, n, e = c.emb_dim, c.num_heads, c.qk_head_dim
    ck, r = c.kv_lora_rank, c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = d * n * e
    else:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * e  # q_a, its norm, q_b
    kv = d * (ck + r) + ck + ck * n * (c.qk_nope_head_dim + c.v_head_dim)  # kv_a, norm, kv_b
    return q + kv + n * c.v_head_dim * d  # + o


def param_counts(c: DeepSeekModelConfig, moe: MoEConfig) -> ParamCounts:
    d = c.emb_dim
    n_moe = sum(c.moe_layers())
    n_dense = c.num_layers - n_moe
    expert = 3 * d * moe.moe_intermediate_size
    shared_width = moe.num_shared_experts * (
        moe.shared_intermediate_size or moe.moe_intermediate_size
    )
    moe_common = d * moe.num_experts + 3 * d * shared_width  # router + shared experts
    layers = c.num_layers * (mla_params(c) + 2 * d) + n_dense * 3 * d * c.mlp_dim
    layers += n_moe * (moe_common + moe.num_experts * expert)
    embedding = c.vocab_size * d
    head = 0 if c.tie_embeddings else d * c.vocab_size
    # Multi-token prediction (mtp.py), per depth: enorm, hnorm, shared_head.norm, eh_proj
    # [2D, D] and one MoE decoder layer; the embedding and head are the model's (shared).
    mtp_layer = mla_params(c) + 2 * d + moe_common + moe.num_experts * expert
    mtp = c.mtp_layers * (3 * d + 2 * d * d + mtp_layer)
    total = embedding + head + d + layers + mtp  # d: the final norm
    # MTP layers count as active (a training token runs them; decoding does not).
    inactive = (n_moe + c.mtp_layers) * (moe.num_experts - moe.num_experts_per_tok) * expert
    return {"total": total, "active": total - inactive, "embedding": embedding}


def mla_attention_flops(c: DeepSeekModelConfig, seq_len: int) -> float:
    """QK^T (qk_nope + qk_rope dims) and AV (v_head_dim), forward and backward, full square:
    6 * L * N * S * (qk_head_dim + v_head_dim) (= models/flops.py's 12 L N H S when both are
    H; MaxText counts MLA the same way)."""
    dims = c.qk_head_dim + c.v_head_dim
    return float(6 * c.num_layers * c.num_heads * dims * seq_len)


def flops_per_token(c: DeepSeekModelConfig, moe: MoEConfig, seq_len: int) -> float:
    """6 * active non-embedding params + MLA's attention term, MTP included: its params are in
    the active count, and per depth it adds one layer's attention term and a second use of the
    shared head (6 * D * V: the head's params are counted once)."""
    attention = mla_attention_flops(c, seq_len)
    attention += attention / c.num_layers * c.mtp_layers  # one MLA layer per depth
    mtp_head = 6 * c.mtp_layers * c.emb_dim * c.vocab_size
    return six_n_plus_attention(param_counts(c, moe), c, attention) + mtp_head
