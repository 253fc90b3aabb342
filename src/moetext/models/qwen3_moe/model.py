"""The Qwen3 decoder-only transformer: embedding, N x (attention + dense-or-MoE MLP), norm, head.

Legend: B batch, S sequence, D emb_dim, V vocab, H head_dim, L layers in a scanned stack.

The family picks which layers hold the MoE block (`moe_pattern`): qwen3_moe by
`moe_layer_pattern` (the HF Qwen3-MoE rule), dense none. With scan_layers, each run of
consecutive layers of the same kind is one stacked module (params get a leading "layers" axis)
run by jax.lax.scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig
from moetext.kernels.gmm import Gmm
from moetext.models.family import CacheArray, zeros_cache
from moetext.models.layers.attention import Attention, KVCache
from moetext.models.layers.decoder import (
    Aux,
    LayerStack,
    PreNormLayer,
    check_inputs,
    check_stack_config,
)
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.rope import rope_cos_sin
from moetext.models.layers.scan import segments
from moetext.models.moe.experts import gmm_from_config
from moetext.models.moe.layers import AuxAccumulator, for_each_moe_block
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig


def moe_layer_pattern(cfg: QwenModelConfig) -> tuple[bool, ...]:
    """Per layer: True where the HF Qwen3-MoE rule selects the MoE block."""
    if cfg.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {cfg.decoder_sparse_step}")
    only = set(cfg.mlp_only_layers)
    return tuple(
        (i + 1) % cfg.decoder_sparse_step == 0 and i not in only for i in range(cfg.num_layers)
    )


def decode_cache(cfg: ModelConfig, batch: int, length: int) -> list[Any]:
    """Per layer, a KVCache of CacheArray: the post-RoPE keys and values of the kv heads,
    [B, T, K, H] in the compute dtype (`ModelFamily.decode_cache`; `init_cache` zeroes it)."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    kv: Any = CacheArray(shape, cfg.dtype, ("batch", None, "kv_heads", "head_dim"))
    return [KVCache(kv, kv) for _ in range(cfg.num_layers)]


class DecoderLayer(PreNormLayer):
    """Pre-norm block (layers/decoder.py) around GQA attention with a KV cache; returns
    (out, aux). gmm: the grouped matmul of the MoE block (unused by a dense layer)."""

    def __init__(
        self,
        cfg: QwenModelConfig,
        moe_cfg: QwenMoEConfig,
        gmm: Gmm,
        *,
        use_moe: bool,
        rngs: nnx.Rngs,
    ):
        def make_attn(r: nnx.Rngs) -> Attention:
            return Attention(cfg, qk_norm=cfg.qk_norm, bias=cfg.attention_bias, rngs=r)

        super().__init__(
            cfg,
            moe_cfg,
            gmm,
            make_attn,
            use_moe=use_moe,
            rngs=rngs,
            shared_expert_gate=moe_cfg.shared_expert_gate,
        )


class Decoder(LayerStack):
    """tokens_BS -> (logits_BSV float32, aux); `hidden_states` stops before the LM head (the
    fused training loss, train/loss.py, takes it with `head_VD()`).

    positions_BS (default 0..S-1 in every row) are the RoPE positions. segment_ids_BS (default
    None: one document per row, causal attention only) marks packed documents, 1, 2, ... in row
    order and 0 for padding: a token attends only to earlier tokens of its own segment, so each
    document's logits are those of the document run alone (at its positions).

    aux: float32 scalars moe_loss (weighted, ready to add to the CE loss), load_balance_loss,
    router_z_loss, dropped_fraction; each is the mean over MoE layers (zeros with none). With MoE
    layers also the blocks' per-layer statistics stacked [num_moe_layers, ...] in layer order
    (models/moe/layers.py): expert_load [N, E] (the fraction of the non-padding tokens'
    assignments each expert received; rows sum to 1), expert_counts [N, E], and what the router
    adds (sigmoid_topk: selection_bias [N, E]).

    Its routers' non-parameter state (a selection bias, a global-batch load buffer) is updated
    by `update_model_state(aux)` after each optimizer step and `accumulate_model_state(aux)`
    after each micro-batch (models.ModelStateLM).
    """

    cfg: QwenModelConfig

    def __init__(
        self,
        cfg: QwenModelConfig,
        moe_cfg: QwenMoEConfig,
        kernels_cfg: KernelsConfig,
        *,
        moe_pattern: Sequence[bool],
        rngs: nnx.Rngs,
    ):
        _check_model_config(cfg)
        if len(moe_pattern) != cfg.num_layers:
            raise ValueError(
                f"moe_pattern has {len(moe_pattern)} entries for {cfg.num_layers} layers"
            )
        pdt, self.dtype = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        self.cfg = cfg
        gmm = gmm_from_config(kernels_cfg)  # built once, shared by every MoE layer
        self.num_moe_layers = sum(bool(m) for m in moe_pattern)
        self.segments = segments(moe_pattern)
        init = normal(cfg.init_std)
        self.embed = make_param(rngs, init, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), pdt)

        def make_layer(use_moe: bool, key: jax.Array) -> DecoderLayer:
            r = nnx.Rngs(params=key)
            return DecoderLayer(cfg, moe_cfg, gmm, use_moe=use_moe, rngs=r)

        self.build_layers(make_layer, moe_pattern, rngs.params())
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            # [V, D] like the embedding (and HF's lm_head.weight): on XLA:CPU the backward
            # matmuls of this layout run ~4x faster than [D, V] (see docs/performance.md).
            self.lm_head = make_param(
                rngs, init, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), pdt
            )

    def hidden_states(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        """`__call__` up to the LM head: (the final norm's output x_BSD in the compute dtype,
        aux); the logits are x_BSD @ head_VD().T."""
        positions_BS = check_inputs(tokens_BS, positions_BS, segment_ids_BS)
        cos_BSH, sin_BSH = self.cos_sin(positions_BS)
        acc = AuxAccumulator(self.num_moe_layers)
        x_BSD = self.run_layers(self.embed_tokens(tokens_BS), cos_BSH, sin_BSH, segment_ids_BS, acc)
        return self.final_norm(x_BSD), acc.result()

    def cos_sin(self, positions_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE cos, sin [B, S, H] float32 at integer positions."""
        return rope_cos_sin(positions_BS, self.cfg.head_dim, self.cfg.rope_theta)

    def update_model_state(self, aux: Aux) -> None:
        """After an optimizer step: each MoE block updates its router's state from its rows of
        the step's aux (e.g. the aux-loss-free selection bias)."""
        for_each_moe_block(self.stack_moe_groups(), aux, "update_state")

    def accumulate_model_state(self, aux: Aux) -> None:
        """After one micro-batch of an accumulated step (e.g. the global-batch load buffer)."""
        for_each_moe_block(self.stack_moe_groups(), aux, "accumulate_state")

    def init_cache(self, batch: int, length: int) -> list[KVCache]:
        """Zero KV caches for `batch` rows of `length` slots, one per layer (compute dtype)."""
        caches: list[KVCache] = zeros_cache(decode_cache(self.cfg, batch, length))
        return caches


def _check_model_config(cfg: QwenModelConfig) -> None:
    check_stack_config(cfg, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    bad_only = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_layers]
    if bad_only:
        raise ValueError(f"mlp_only_layers {bad_only} out of range for {cfg.num_layers} layers")
