"""The Qwen3 decoder-only transformer: embedding, N x (attention + dense-or-MoE MLP), norm, head.

Legend: B batch, S sequence, D emb_dim, V vocab, H head_dim, L layers in a scanned stack.

The family picks which layers hold the MoE block (`moe_pattern`): qwen3_moe by
`moe_layer_pattern` (the HF Qwen3-MoE rule), dense none. With scan_layers, each run of
consecutive layers of the same kind is one stacked module (params get a leading "layers" axis)
run by jax.lax.scan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.config.schema import KernelsConfig, ModelConfig
from moetext.kernels.gmm import Gmm
from moetext.models.family import CacheArray, zeros_cache
from moetext.models.layers.attention import Attention, KVCache
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.rope import rope_cos_sin
from moetext.models.layers.rowdot import dot_rows
from moetext.models.layers.scan import check_remat_policy, make_stack, remat, segments
from moetext.models.moe.block import MoEBlock, zero_aux
from moetext.models.moe.experts import gmm_from_config
from moetext.models.moe.layers import AuxAccumulator, for_each_moe_block
from moetext.models.moe.routers import build_router
from moetext.models.qwen3_moe.config import QwenModelConfig, QwenMoEConfig
from moetext.sharding.logical import constrain

ACT_NAMES = ("batch", "length", "embed")
Aux = dict[str, jax.Array]
LayerState = nnx.State[Any, Any]
# (x_BSD, layer state, cos_BSH, sin_BSH, segment_ids_BS) -> (x_BSD, aux): one layer, remat'd.
LayerStep = Callable[
    [jax.Array, LayerState, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, Aux]
]


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


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); returns (out, aux).

    gmm: the grouped matmul of the MoE block (unused by a dense layer)."""

    def __init__(
        self,
        cfg: QwenModelConfig,
        moe_cfg: QwenMoEConfig,
        gmm: Gmm,
        *,
        use_moe: bool,
        rngs: nnx.Rngs,
    ):
        pdt, dt = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        self.use_moe = bool(use_moe)
        self.attn_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(cfg, qk_norm=cfg.qk_norm, bias=cfg.attention_bias, rngs=rngs)
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
                shared_expert_gate=moe_cfg.shared_expert_gate,
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
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        x_BSD = constrain(x_BSD, ACT_NAMES)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_BSH, sin_BSH, segment_ids_BS)
        aux: Aux
        if isinstance(self.mlp, MoEBlock):
            y_BSD, aux = self.mlp(self.mlp_norm(h_BSD), segment_ids_BS)
        else:
            y_BSD, aux = self.mlp(self.mlp_norm(h_BSD)), zero_aux()
        return constrain(h_BSD + y_BSD, ACT_NAMES), aux

    def cached(
        self,
        x_BSD: jax.Array,
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        cache: KVCache,
        start: jax.Array,
        mask_BST: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """The layer on S new tokens against its KV cache (decoding); MoE aux is dropped."""
        attn_BSD, cache = self.attn.cached(
            self.attn_norm(x_BSD), cos_BSH, sin_BSH, cache, start, mask_BST
        )
        h_BSD = x_BSD + attn_BSD
        y_BSD = (
            self.mlp.decode(self.mlp_norm(h_BSD))
            if isinstance(self.mlp, MoEBlock)
            else (self.mlp(self.mlp_norm(h_BSD)))
        )
        return h_BSD + y_BSD, cache


def _layer_step(graphdef: nnx.GraphDef[DecoderLayer], policy: str, *, in_scan: bool) -> LayerStep:
    def step(
        x_BSD: jax.Array,
        state: LayerState,
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        segment_ids_BS: jax.Array | None,
    ) -> tuple[jax.Array, Aux]:
        layer: DecoderLayer = nnx.merge(graphdef, state)
        return layer(x_BSD, cos_BSH, sin_BSH, segment_ids_BS)

    return remat(step, policy, in_scan=in_scan)


class Decoder(nnx.Module):
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

        # Layer i draws from its own key fold_in(base, i), in both layouts, so a scanned and an
        # unrolled model built from the same seed hold the same weights (restacked).
        base_key = rngs.params()

        def make_layer(use_moe: bool, key: jax.Array) -> DecoderLayer:
            r = nnx.Rngs(params=key)
            return DecoderLayer(cfg, moe_cfg, gmm, use_moe=use_moe, rngs=r)

        if cfg.scan_layers:
            stacks, start = [], 0
            for use_moe, count in self.segments:
                keys = [jax.random.fold_in(base_key, i) for i in range(start, start + count)]
                stacks.append(make_stack(make_layer, use_moe, jnp.stack(keys)))
                start += count
            self.stacks = nnx.List(stacks)
        else:
            keys = [jax.random.fold_in(base_key, i) for i in range(cfg.num_layers)]
            self.layers = nnx.List(
                [make_layer(bool(m), k) for m, k in zip(moe_pattern, keys, strict=True)]
            )
        self.final_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            # [V, D] like the embedding (and HF's lm_head.weight): on XLA:CPU the backward
            # matmuls of this layout run ~4x faster than [D, V] (see docs/performance.md).
            self.lm_head = make_param(
                rngs, init, (cfg.vocab_size, cfg.emb_dim), ("vocab", "embed"), pdt
            )

    def __call__(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        x_BSD, aux = self.hidden_states(
            tokens_BS, positions_BS=positions_BS, segment_ids_BS=segment_ids_BS
        )
        # Logits come out in the compute dtype and the loss upcasts them to f32 (MaxText's
        # default too): an f32-output bf16 matmul is ~3x slower on CPU for the [T, V] logits.
        # The training loss skips this einsum unless model.loss_chunk_size = 0 (train/loss.py).
        logits_BSV = jnp.einsum("bsd,vd->bsv", x_BSD, self.head_VD().astype(self.dtype))
        logits_BSV = logits_BSV.astype(jnp.float32)
        logits_BSV = constrain(logits_BSV, ("batch", "length", "vocab"))
        return logits_BSV, aux

    def hidden_states(
        self,
        tokens_BS: jax.Array,
        *,
        positions_BS: jax.Array | None = None,
        segment_ids_BS: jax.Array | None = None,
    ) -> tuple[jax.Array, Aux]:
        """`__call__` up to the LM head: (the final norm's output x_BSD in the compute dtype,
        aux); the logits are x_BSD @ head_VD().T."""
        cfg = self.cfg
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
        cos_BSH, sin_BSH = rope_cos_sin(positions_BS, cfg.head_dim, cfg.rope_theta)
        x_BSD = jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)
        x_BSD, aux = self._run_layers(x_BSD, cos_BSH, sin_BSH, segment_ids_BS)
        return self.final_norm(x_BSD), aux

    def update_model_state(self, aux: Aux) -> None:
        """After an optimizer step: each MoE block updates its router's state from its rows of
        the step's aux (e.g. the aux-loss-free selection bias)."""
        for_each_moe_block(self._moe_groups(), aux, "update_state")

    def accumulate_model_state(self, aux: Aux) -> None:
        """After one micro-batch of an accumulated step (e.g. the global-batch load buffer)."""
        for_each_moe_block(self._moe_groups(), aux, "accumulate_state")

    def _moe_groups(self) -> list[tuple[nnx.Module, int, bool]]:
        if self.cfg.scan_layers:
            runs = zip(self.stacks, self.segments, strict=True)
            return [(stack, count, True) for stack, (is_moe, count) in runs if is_moe]
        return [(layer, 1, False) for layer in self.layers if layer.use_moe]

    def head_VD(self) -> jax.Array:
        """The LM head's weight [V, D] in the param dtype (the embedding when tied)."""
        head_VD: jax.Array = self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]
        return head_VD

    @property
    def loss_chunk_size(self) -> int:
        """model.loss_chunk_size: vocab rows per chunk of the fused loss; 0 = the logits path."""
        return self.cfg.loss_chunk_size

    def init_cache(self, batch: int, length: int) -> list[KVCache]:
        """Zero KV caches for `batch` rows of `length` slots, one per layer (compute dtype)."""
        caches: list[KVCache] = zeros_cache(decode_cache(self.cfg, batch, length))
        return caches

    def cached(
        self,
        tokens_BS: jax.Array,
        positions_BS: jax.Array,
        caches: list[KVCache],
        start: jax.Array,
        first_valid_B: jax.Array,
    ) -> tuple[jax.Array, list[KVCache]]:
        """Decoding: S new tokens (the same cache slots start..start+S-1 for every row; S = the
        padded prompt length at prefill, 1 per decode step) -> (logits_BSV float32, caches).

        Rows are left-padded: row b's real tokens start at slot first_valid_B[b], and a query
        at slot j sees the keys at slots first_valid_B[b]..j. positions_BS are the RoPE
        positions (slot - first_valid). Needs the unscanned layout (load with scan_layers off).
        """
        if self.cfg.scan_layers:
            raise ValueError(
                "decoding runs the unscanned layer layout: build the model with "
                "model.scan_layers=false (checkpoint.load_params_from / moetext.generate "
                "unstack a scanned checkpoint)"
            )
        b, s = tokens_BS.shape
        length = caches[0].k_BTKH.shape[1]
        slots_S = start + jnp.arange(s)
        t_T = jnp.arange(length)
        mask_BST = (t_T[None, None, :] <= slots_S[None, :, None]) & (
            t_T[None, None, :] >= first_valid_B[:, None, None]
        )
        cos_BSH, sin_BSH = rope_cos_sin(positions_BS, self.cfg.head_dim, self.cfg.rope_theta)
        x_BSD = jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x_BSD, cache = layer.cached(x_BSD, cos_BSH, sin_BSH, cache, start, mask_BST)
            new_caches.append(cache)
        x_TD = self.final_norm(x_BSD).reshape(b * s, -1)
        # dot_rows: a batch-1 decode step is one row, which XLA:CPU would multiply by a float32
        # copy of the whole head (layers/rowdot.py); the values are __call__'s.
        logits_TV = dot_rows(
            x_TD, self.head_VD(), w_contract=1, dtype=self.dtype, out_dtype=jnp.float32
        )
        return logits_TV.reshape(b, s, -1), new_caches

    def _run_layers(
        self,
        x_BSD: jax.Array,
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        segment_ids_BS: jax.Array | None,
    ) -> tuple[jax.Array, Aux]:
        """-> (x_BSD, the model's aux: see the class docstring)."""
        policy = self.cfg.remat_policy
        acc = AuxAccumulator(self.num_moe_layers)
        if self.cfg.scan_layers:
            for stack in self.stacks:
                graphdef, state = nnx.split(stack)
                step = _layer_step(graphdef, policy, in_scan=True)

                def body(
                    x: jax.Array, st: LayerState, step: LayerStep = step
                ) -> tuple[jax.Array, Aux]:
                    return step(x, st, cos_BSH, sin_BSH, segment_ids_BS)

                x_BSD, aux_L = jax.lax.scan(body, x_BSD, state)
                acc.add_stack(aux_L)  # scan stacked the layers' aux: [L, ...]
        else:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x_BSD, aux = _layer_step(graphdef, policy, in_scan=False)(
                    x_BSD, state, cos_BSH, sin_BSH, segment_ids_BS
                )
                acc.add_layer(aux)
        return x_BSD, acc.result()


def _check_model_config(cfg: QwenModelConfig) -> None:
    check_remat_policy(cfg.remat_policy)
    dims = {
        "vocab_size": cfg.vocab_size,
        "emb_dim": cfg.emb_dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "mlp_dim": cfg.mlp_dim,
    }
    bad = {k: v for k, v in dims.items() if v < 1}
    if bad:
        raise ValueError(f"model dimensions must be >= 1, got {bad}")
    bad_only = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_layers]
    if bad_only:
        raise ValueError(f"mlp_only_layers {bad_only} out of range for {cfg.num_layers} layers")
