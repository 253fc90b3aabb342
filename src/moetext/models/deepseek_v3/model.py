"""The DeepSeek-V3 decoder (also Kimi K2, Moonlight-16B-A3B): embedding, N x (MLA + dense-or-MoE
MLP), final norm, LM head.

Legend: B batch, S sequence, T cache slots, D emb_dim, V vocab, R qk_rope_head_dim, L layers
of a scanned stack.

    h = x + MLA(RMSNorm(x))
    y = h + FFN(RMSNorm(h))      FFN: SwiGLU of width mlp_dim in the first first_k_dense_replace
                                 layers, then the MoE block (shared experts + routed experts
                                 through moe.router, sigmoid_topk for DeepSeek-V3)

The MoE layers are the shared models/moe/block.py MoEBlock, so every gmm backend, quantization
recipe, dispatch mode and expert-parallel layout works as for Qwen3. With scan_layers the dense
prefix and the MoE layers are two scanned stacks (layers/scan.py). Multi-token prediction
(model.mtp_layers > 0, mtp.py) runs after the stack in the training forward only, when the
trainer's loss passes `targets` (models.TargetsLM): decoding and plain calls skip it; its params
are the model's like any other (checkpoints, conversion).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from moetext.config.schema import KernelsConfig, MoEConfig
from moetext.kernels.gmm import Gmm
from moetext.models.deepseek_v3 import rope
from moetext.models.deepseek_v3.config import DeepSeekModelConfig
from moetext.models.deepseek_v3.mla import MLA, MLACache, MLAConfig
from moetext.models.deepseek_v3.mtp import MTP, MTP_LOSS_KEY
from moetext.models.family import CacheArray, LossTargets, zeros_cache
from moetext.models.layers.decoder import (
    Aux,
    LayerStack,
    PreNormLayer,
    check_inputs,
    check_stack_config,
    layer_step,
)
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.scan import segments
from moetext.models.moe.experts import gmm_from_config
from moetext.models.moe.layers import AuxAccumulator, for_each_moe_block, per_layer

# The epsilon of MLA's q_a and kv_a RMSNorms (see mla_config).
MLA_NORM_EPS = 1e-6


def mla_config(cfg: DeepSeekModelConfig) -> MLAConfig:
    """The attention fields of the model section, as one MLA layer's config: every MLAConfig
    field is the model's field of that name (yarn: its YaRN property) but rms_norm_eps, which
    is MLA_NORM_EPS: q_a_layernorm and kv_a_layernorm use RMSNorm's default 1e-6 in
    transformers' DeepseekV3Attention and DeepSeek's reference code, whatever
    config.rms_norm_eps says."""
    shared = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(MLAConfig)
        if f.name != "rms_norm_eps"
    }
    return MLAConfig(**shared, rms_norm_eps=MLA_NORM_EPS)


def decode_cache(cfg: DeepSeekModelConfig, batch: int, length: int) -> list[Any]:
    """Per layer, an MLACache of CacheArray: the normalised latent [B, T, kv_lora_rank] and the
    post-RoPE shared key [B, T, qk_rope_head_dim] in the compute dtype, not per-head keys and
    values (`ModelFamily.decode_cache`; `init_cache` zeroes it)."""
    names = ("batch", None, None)
    latent: Any = CacheArray((batch, length, cfg.kv_lora_rank), cfg.dtype, names)
    k_rope: Any = CacheArray((batch, length, cfg.qk_rope_head_dim), cfg.dtype, names)
    return [MLACache(latent, k_rope) for _ in range(cfg.num_layers)]


class DecoderLayer(PreNormLayer):
    """Pre-norm block (layers/decoder.py) around MLA with its latent cache; -> (out, aux).

    mlp is a SwiGLU of width mlp_dim (dense layer) or the MoE block (gmm: its grouped matmul)."""

    def __init__(
        self,
        cfg: DeepSeekModelConfig,
        moe_cfg: MoEConfig,
        gmm: Gmm,
        *,
        use_moe: bool,
        rngs: nnx.Rngs,
    ):
        def make_attn(r: nnx.Rngs) -> MLA:
            return MLA(mla_config(cfg), rngs=r)

        super().__init__(cfg, moe_cfg, gmm, make_attn, use_moe=use_moe, rngs=rngs)


class Decoder(LayerStack):
    """tokens_BS -> (logits_BSV float32, aux); `hidden_states` stops before the LM head (the
    fused training loss takes it with `head_VD()`).

    positions_BS (default 0..S-1 per row) are the RoPE positions; segment_ids_BS (default None:
    one document per row) marks packed documents 1, 2, ... and 0 for padding: a token attends
    only to earlier tokens of its own segment.

    aux: as the Qwen3 decoder's (models/qwen3_moe/model.py): moe_loss, load_balance_loss,
    router_z_loss, dropped_fraction (means over MoE layers) and the per-MoE-layer statistics
    stacked [num_moe_layers, ...] in layer order (expert_load, expert_counts, and with
    sigmoid_topk the selection_bias). `update_model_state(aux)` after each optimizer step moves
    the routers' selection bias (aux-loss-free balancing); `accumulate_model_state(aux)` after
    each micro-batch.

    Decoding (`init_cache`, `cached`) keeps per layer the compressed latent and the shared RoPE
    key (kv_lora_rank + qk_rope_head_dim numbers per token), the up-projections absorbed into
    the query and the output (deepseek_v3/mla.py).
    """

    cfg: DeepSeekModelConfig

    def __init__(
        self,
        cfg: DeepSeekModelConfig,
        moe_cfg: MoEConfig,
        kernels_cfg: KernelsConfig,
        *,
        rngs: nnx.Rngs,
    ):
        check_stack_config(cfg)
        pdt, self.dtype = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        self.cfg = cfg
        pattern = cfg.moe_layers()
        gmm = gmm_from_config(kernels_cfg)  # built once, shared by every MoE layer
        self.num_moe_layers = sum(pattern)
        self.segments = segments(pattern)
        # RoPE tables (YaRN-scaled), static like the config: every layer's MLA uses the same.
        self.inv_freq_h = tuple(
            float(f) for f in rope.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn)
        )
        self.attention_factor = 1.0 if cfg.yarn is None else rope.yarn_attention_factor(cfg.yarn)
        init = normal(cfg.init_std)
        self.embed = make_param(rngs, init, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), pdt)

        base_key = rngs.params()

        def make_layer(use_moe: bool, key: jax.Array) -> DecoderLayer:
            return DecoderLayer(cfg, moe_cfg, gmm, use_moe=use_moe, rngs=nnx.Rngs(params=key))

        self.build_layers(make_layer, pattern, base_key)
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            # [V, D] like the embedding and HF's lm_head.weight (see qwen3_moe/model.py).
            self.lm_head = make_param(
                rngs, init, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), pdt
            )
        if cfg.mtp_layers > 0:
            # Depth k's layer is HF's layer num_layers + k - 1, an MoE layer, drawn from the key
            # that layer index would have in the stack.
            self.mtp = MTP(
                cfg.mtp_layers,
                cfg.emb_dim,
                lambda k: make_layer(True, jax.random.fold_in(base_key, cfg.num_layers + k - 1)),
                weight=cfg.mtp_loss_weight,
                eps=cfg.rms_norm_eps,
                init_std=cfg.init_std,
                param_dtype=pdt,
                rngs=rngs,
            )

    def hidden_states(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
        targets: LossTargets | None = None,
    ) -> tuple[jax.Array, Aux]:
        """`__call__` up to the LM head: (the final norm's output x_BSD in the compute dtype,
        aux); the logits are x_BSD @ head_VD().T. With targets (the trainer's loss) and MTP
        modules, aux also holds mtp_loss and extra_loss (mtp_loss_weight x mtp_loss), and the
        MTP layers' MoE aux joins the stack's (scalars averaged over all MoE layers, their
        per-layer rows after the stack's)."""
        positions_BS = check_inputs(tokens_BS, positions_BS, segment_ids_BS)
        cos_BSR, sin_BSR = self.cos_sin(positions_BS)
        x_BSD = self.embed_tokens(tokens_BS)
        mtp = targets is not None and self.reads_targets
        acc = AuxAccumulator(self.num_moe_layers + (self.cfg.mtp_layers if mtp else 0))
        x_BSD = self.run_layers(x_BSD, cos_BSR, sin_BSR, segment_ids_BS, acc)
        mtp_aux: Aux = {}
        if targets is not None and mtp:
            mtp_aux = self._run_mtp(x_BSD, targets, cos_BSR, sin_BSR, segment_ids_BS, acc)
        return self.final_norm(x_BSD), {**acc.result(), **mtp_aux}

    @property
    def reads_targets(self) -> bool:
        """models.TargetsLM: the training loss passes targets when there are MTP modules."""
        return self.cfg.mtp_layers > 0

    @property
    def loss_terms(self) -> tuple[str, ...]:
        """models.TargetsLM: the unweighted loss terms it adds to aux with targets."""
        return (MTP_LOSS_KEY,) if self.reads_targets else ()

    def _run_mtp(
        self,
        h0_BSD: jax.Array,
        targets: LossTargets,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None,
        acc: AuxAccumulator,
    ) -> Aux:
        """The MTP depths on the stack's output before the final norm -> their loss terms; each
        depth's layer runs as a stack layer (remat policy, RoPE, segment ids) into acc."""

        def run_layer(layer: nnx.Module, x_BSD: jax.Array) -> tuple[jax.Array, Aux]:
            assert isinstance(layer, DecoderLayer)  # what the MTP depths were built with
            graphdef, state = nnx.split(layer)
            step = layer_step(graphdef, self.cfg.remat_policy, in_scan=False)
            x_BSD, aux = step(x_BSD, state, cos_BSR, sin_BSR, segment_ids_BS)
            acc.add_layer(aux)
            return x_BSD, aux

        mtp_aux, _ = self.mtp(
            h0_BSD, self.embed[...], self.head_VD(), targets, segment_ids_BS, run_layer
        )
        return mtp_aux

    def cos_sin(self, positions_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE cos, sin [B, S, R] float32 at integer positions (YaRN-scaled when configured)."""
        return rope.rope_cos_sin(positions_BS, self.inv_freq_h, self.attention_factor)

    def update_model_state(self, aux: Aux) -> None:
        """After an optimizer step: each MoE block updates its router's state from its rows of
        the step's aux (the aux-loss-free selection bias)."""
        for_each_moe_block(self._moe_groups(aux), aux, "update_state")

    def accumulate_model_state(self, aux: Aux) -> None:
        """After one micro-batch of an accumulated step (e.g. the global-batch load buffer)."""
        for_each_moe_block(self._moe_groups(aux), aux, "accumulate_state")

    def _moe_groups(self, aux: Aux) -> list[tuple[nnx.Module, int, bool]]:
        """The MoE blocks with rows in aux: the stack's, then the MTP layers' when aux came
        from a training forward that ran them."""
        groups = self.stack_moe_groups()
        rows = [len(v) for v in per_layer(aux).values()]
        if self.reads_targets and rows and rows[0] > self.num_moe_layers:
            groups += [(depth.layer, 1, False) for depth in self.mtp.depths]
        return groups

    def init_cache(self, batch: int, length: int) -> list[MLACache]:
        """Zero latent caches for `batch` rows of `length` slots, one per layer."""
        caches: list[MLACache] = zeros_cache(decode_cache(self.cfg, batch, length))
        return caches
