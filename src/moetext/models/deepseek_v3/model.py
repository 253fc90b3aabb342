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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.config.schema import KernelsConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.kernels.gmm import Gmm
from moetext.models.deepseek_v3 import rope
from moetext.models.deepseek_v3.config import DeepSeekModelConfig
from moetext.models.deepseek_v3.mla import MLA, MLACache, MLAConfig
from moetext.models.deepseek_v3.mtp import MTP, MTP_LOSS_KEY
from moetext.models.family import CacheArray, LossTargets, zeros_cache
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.rowdot import dot_rows
from moetext.models.layers.scan import check_remat_policy, make_stack, remat, segments
from moetext.models.moe.block import MoEBlock, zero_aux
from moetext.models.moe.experts import gmm_from_config
from moetext.models.moe.layers import AuxAccumulator, for_each_moe_block, per_layer
from moetext.models.moe.routers import build_router
from moetext.sharding.logical import constrain

ACT_NAMES = ("batch", "length", "embed")
# The epsilon of MLA's q_a and kv_a RMSNorms (see mla_config).
MLA_NORM_EPS = 1e-6
Aux = dict[str, jax.Array]
LayerState = nnx.State[Any, Any]
# (x_BSD, layer state, cos_BSR, sin_BSR, segment_ids_BS) -> (x_BSD, aux): one layer, remat'd.
LayerStep = Callable[
    [jax.Array, LayerState, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, Aux]
]


def mla_config(cfg: DeepSeekModelConfig) -> MLAConfig:
    """The attention fields of the model section, as one MLA layer's config."""
    return MLAConfig(
        emb_dim=cfg.emb_dim,
        num_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        # q_a_layernorm and kv_a_layernorm: RMSNorm's default 1e-6 in transformers'
        # DeepseekV3Attention and DeepSeek's reference code, whatever config.rms_norm_eps says.
        rms_norm_eps=MLA_NORM_EPS,
        rope_theta=cfg.rope_theta,
        rope_interleave=cfg.rope_interleave,
        yarn=cfg.yarn,
        init_std=cfg.init_std,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
    )


def decode_cache(cfg: DeepSeekModelConfig, batch: int, length: int) -> list[Any]:
    """Per layer, an MLACache of CacheArray: the normalised latent [B, T, kv_lora_rank] and the
    post-RoPE shared key [B, T, qk_rope_head_dim] in the compute dtype, not per-head keys and
    values (`ModelFamily.decode_cache`; `init_cache` zeroes it)."""
    names = ("batch", None, None)
    latent: Any = CacheArray((batch, length, cfg.kv_lora_rank), cfg.dtype, names)
    k_rope: Any = CacheArray((batch, length, cfg.qk_rope_head_dim), cfg.dtype, names)
    return [MLACache(latent, k_rope) for _ in range(cfg.num_layers)]


class DecoderLayer(nnx.Module):
    """Pre-norm block: h = x + attn(attn_norm(x)), out = h + mlp(mlp_norm(h)); -> (out, aux).

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
        pdt, dt = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        self.use_moe = bool(use_moe)
        self.attn_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = MLA(mla_config(cfg), rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if self.use_moe:
            router = build_router(
                moe_cfg, emb_dim=cfg.emb_dim, init_std=cfg.init_std, param_dtype=pdt, rngs=rngs
            )
            self.mlp: MoEBlock | SwiGLU = MoEBlock(
                moe_cfg,
                gmm,
                router=router,
                emb_dim=cfg.emb_dim,
                init_std=cfg.init_std,
                param_dtype=pdt,
                dtype=dt,
                rngs=rngs,
            )
        else:
            self.mlp = SwiGLU(
                cfg.emb_dim,
                cfg.mlp_dim,
                init_std=cfg.init_std,
                param_dtype=pdt,
                dtype=dt,
                rngs=rngs,
            )

    def __call__(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        x_BSD = constrain(x_BSD, ACT_NAMES)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_BSR, sin_BSR, segment_ids_BS)
        aux: Aux
        if isinstance(self.mlp, MoEBlock):
            y_BSD, aux = self.mlp(self.mlp_norm(h_BSD), segment_ids_BS)
        else:
            y_BSD, aux = self.mlp(self.mlp_norm(h_BSD)), zero_aux()
        return constrain(h_BSD + y_BSD, ACT_NAMES), aux

    def cached(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        cache: MLACache,
        start: jax.Array,
        mask_BST: jax.Array,
    ) -> tuple[jax.Array, MLACache]:
        """The layer on S new tokens against its latent cache (decoding); MoE aux is dropped."""
        attn_BSD, cache = self.attn.cached(
            self.attn_norm(x_BSD), cos_BSR, sin_BSR, cache, start, mask_BST
        )
        h_BSD = x_BSD + attn_BSD
        normed_BSD = self.mlp_norm(h_BSD)
        if isinstance(self.mlp, MoEBlock):
            return h_BSD + self.mlp.decode(normed_BSD), cache
        return h_BSD + self.mlp(normed_BSD), cache


def _layer_step(graphdef: nnx.GraphDef[DecoderLayer], policy: str, *, in_scan: bool) -> LayerStep:
    def step(
        x_BSD: jax.Array,
        state: LayerState,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None,
    ) -> tuple[jax.Array, Aux]:
        layer: DecoderLayer = nnx.merge(graphdef, state)
        return layer(x_BSD, cos_BSR, sin_BSR, segment_ids_BS)

    return remat(step, policy, in_scan=in_scan)


class Decoder(nnx.Module):
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

    def __init__(
        self,
        cfg: DeepSeekModelConfig,
        moe_cfg: MoEConfig,
        kernels_cfg: KernelsConfig,
        *,
        rngs: nnx.Rngs,
    ):
        check_model_config(cfg)
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

        # Layer i draws from its own key fold_in(base, i), in both layouts, so a scanned and an
        # unrolled model built from the same seed hold the same weights (restacked).
        base_key = rngs.params()

        def make_layer(use_moe: bool, key: jax.Array) -> DecoderLayer:
            return DecoderLayer(cfg, moe_cfg, gmm, use_moe=use_moe, rngs=nnx.Rngs(params=key))

        if cfg.scan_layers:
            stacks, start = [], 0
            for use_moe, count in self.segments:
                keys = [jax.random.fold_in(base_key, i) for i in range(start, start + count)]
                stacks.append(make_stack(make_layer, use_moe, jnp.stack(keys)))
                start += count
            self.stacks = nnx.List(stacks)
        else:
            self.layers = nnx.List(
                [make_layer(m, jax.random.fold_in(base_key, i)) for i, m in enumerate(pattern)]
            )
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

    def __call__(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
        targets: LossTargets | None = None,
    ) -> tuple[jax.Array, Aux]:
        x_BSD, aux = self.hidden_states(
            tokens_BS, positions_BS=positions_BS, segment_ids_BS=segment_ids_BS, targets=targets
        )
        # Logits in the compute dtype, upcast after (as the Qwen3 decoder; the training loss
        # skips this einsum unless model.loss_chunk_size = 0).
        logits_BSV = jnp.einsum("bsd,vd->bsv", x_BSD, self.head_VD().astype(self.dtype))
        logits_BSV = constrain(logits_BSV.astype(jnp.float32), ("batch", "length", "vocab"))
        return logits_BSV, aux

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
        if tokens_BS.ndim != 2 or not jnp.issubdtype(tokens_BS.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be integer [B, S], got {tokens_BS.dtype}{tokens_BS.shape}"
            )
        b, s = tokens_BS.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        elif positions_BS.shape != tokens_BS.shape:
            raise ValueError(f"positions {positions_BS.shape} must match tokens {tokens_BS.shape}")
        if segment_ids_BS is not None and segment_ids_BS.shape != tokens_BS.shape:
            raise ValueError(
                f"segment_ids {segment_ids_BS.shape} must match tokens {tokens_BS.shape}"
            )
        cos_BSR, sin_BSR = self.cos_sin(positions_BS)
        x_BSD = self.embed_tokens(tokens_BS)
        mtp = targets is not None and self.reads_targets
        acc = AuxAccumulator(self.num_moe_layers + (self.cfg.mtp_layers if mtp else 0))
        x_BSD = self._run_layers(x_BSD, cos_BSR, sin_BSR, segment_ids_BS, acc)
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
            step = _layer_step(graphdef, self.cfg.remat_policy, in_scan=False)
            x_BSD, aux = step(x_BSD, state, cos_BSR, sin_BSR, segment_ids_BS)
            acc.add_layer(aux)
            return x_BSD, aux

        mtp_aux, _ = self.mtp(
            h0_BSD, self.embed[...], self.head_VD(), targets, segment_ids_BS, run_layer
        )
        return mtp_aux

    def embed_tokens(self, tokens_BS: jax.Array) -> jax.Array:
        """The embedding rows of tokens_BS in the compute dtype [B, S, D]."""
        return jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)

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
        groups: list[tuple[nnx.Module, int, bool]]
        if self.cfg.scan_layers:
            runs = zip(self.stacks, self.segments, strict=True)
            groups = [(stack, count, True) for stack, (is_moe, count) in runs if is_moe]
        else:
            groups = [(layer, 1, False) for layer in self.layers if layer.use_moe]
        rows = [len(v) for v in per_layer(aux).values()]
        if self.reads_targets and rows and rows[0] > self.num_moe_layers:
            groups += [(depth.layer, 1, False) for depth in self.mtp.depths]
        return groups

    def head_VD(self) -> jax.Array:
        """The LM head's weight [V, D] in the param dtype (the embedding when tied)."""
        head_VD: jax.Array = self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]
        return head_VD

    @property
    def loss_chunk_size(self) -> int:
        """model.loss_chunk_size: vocab rows per chunk of the fused loss; 0 = the logits path."""
        return self.cfg.loss_chunk_size

    def init_cache(self, batch: int, length: int) -> list[MLACache]:
        """Zero latent caches for `batch` rows of `length` slots, one per layer."""
        caches: list[MLACache] = zeros_cache(decode_cache(self.cfg, batch, length))
        return caches

    def cached(
        self,
        tokens_BS: jax.Array,
        positions_BS: jax.Array,
        caches: list[MLACache],
        start: jax.Array,
        first_valid_B: jax.Array,
    ) -> tuple[jax.Array, list[MLACache]]:
        """Decoding: S new tokens at cache slots start..start+S-1 (every row) -> (logits_BSV
        float32, caches). Rows are left-padded: row b's real tokens start at slot
        first_valid_B[b]; positions_BS are the RoPE positions. Needs the unscanned layout."""
        if self.cfg.scan_layers:
            raise ValueError(
                "decoding runs the unscanned layer layout: build the model with "
                "model.scan_layers=false (checkpoint.load_params_from / moetext.generate "
                "unstack a scanned checkpoint)"
            )
        b, s = tokens_BS.shape
        length = caches[0].latent_BTC.shape[1]
        slots_S = start + jnp.arange(s)
        t_T = jnp.arange(length)
        mask_BST = (t_T[None, None, :] <= slots_S[None, :, None]) & (
            t_T[None, None, :] >= first_valid_B[:, None, None]
        )
        cos_BSR, sin_BSR = self.cos_sin(positions_BS)
        x_BSD = self.embed_tokens(tokens_BS)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x_BSD, cache = layer.cached(x_BSD, cos_BSR, sin_BSR, cache, start, mask_BST)
            new_caches.append(cache)
        x_TD = self.final_norm(x_BSD).reshape(b * s, -1)
        # dot_rows: a batch-1 decode step is one row (see layers/rowdot.py); values as __call__.
        logits_TV = dot_rows(
            x_TD, self.head_VD(), w_contract=1, dtype=self.dtype, out_dtype=jnp.float32
        )
        return logits_TV.reshape(b, s, -1), new_caches

    def _run_layers(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None,
        acc: AuxAccumulator,
    ) -> jax.Array:
        """-> x_BSD; each layer's aux goes into acc (the model's aux: see the class docstring)."""
        policy = self.cfg.remat_policy
        if self.cfg.scan_layers:
            for stack in self.stacks:
                graphdef, state = nnx.split(stack)
                step = _layer_step(graphdef, policy, in_scan=True)

                def body(
                    x: jax.Array, st: LayerState, step: LayerStep = step
                ) -> tuple[jax.Array, Aux]:
                    return step(x, st, cos_BSR, sin_BSR, segment_ids_BS)

                x_BSD, aux_L = jax.lax.scan(body, x_BSD, state)
                acc.add_stack(aux_L)  # scan stacked the layers' aux: [L, ...]
        else:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x_BSD, aux = _layer_step(graphdef, policy, in_scan=False)(
                    x_BSD, state, cos_BSR, sin_BSR, segment_ids_BS
                )
                acc.add_layer(aux)
        return x_BSD


def check_model_config(cfg: DeepSeekModelConfig) -> None:
    """What this decoder cannot build yet, and dims the config classes leave unchecked."""
    check_remat_policy(cfg.remat_policy)
    dims = {
        "vocab_size": cfg.vocab_size,
        "emb_dim": cfg.emb_dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "mlp_dim": cfg.mlp_dim,
    }
    bad = {k: v for k, v in dims.items() if v < 1}
    if bad:
        raise ConfigError(f"model dimensions must be >= 1, got {bad}")
