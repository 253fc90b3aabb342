"""What the families' decoders share around their attention: the pre-norm layer (attention, then
a SwiGLU or the MoE block, each behind an RMSNorm and a residual) and the layer stack (built
unrolled or as scan_layers runs, run under the remat policy, decoded against per-layer caches).

Legend: B batch, S sequence, T cache slots, D emb_dim, V vocab, R the RoPE tables' last dim
(the family's head_dim or qk_rope_head_dim), L layers of a scanned stack.

    h = x + attn(attn_norm(x))
    y = h + mlp(mlp_norm(h))     mlp: SwiGLU of width mlp_dim, or the MoE block

A family's layer subclasses `PreNormLayer` and builds its attention (GQA, MLA) with its cache;
the attribute names attn_norm, attn, mlp_norm, mlp are the param tree's (checkpoints, the HF
tensor maps and the sharding rules name them). A family's decoder subclasses `LayerStack`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.config.schema import ModelConfig, MoEConfig
from moetext.errors import ConfigError
from moetext.kernels.gmm import Gmm
from moetext.models.layers.mlp import SwiGLU
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype
from moetext.models.layers.rowdot import dot_rows
from moetext.models.layers.scan import check_remat_policy, make_stack, remat
from moetext.models.moe.block import MoEBlock, zero_aux
from moetext.models.moe.layers import AuxAccumulator
from moetext.models.moe.routers import build_router
from moetext.sharding.logical import constrain

ACT_NAMES = ("batch", "length", "embed")
# The logical axes of a LayerStack decoder, whatever its attention: params of the embedding and
# LM head (vocab, embed), the norms, dense MLP, router and experts (mlp, exp, mlp_moe), the
# attention's heads (heads, head_dim); "layers", scan_layers' stacked axis; activations batch,
# length, embed, vocab (logits). A family adds its attention's own.
STACK_AXES = frozenset(
    "batch length embed vocab heads head_dim mlp exp mlp_moe norm layers".split()
)
Aux = dict[str, jax.Array]
LayerState = nnx.State[Any, Any]
# (x_BSD, layer state, cos_BSR, sin_BSR, segment_ids_BS) -> (x_BSD, aux): one layer, remat'd.
LayerStep = Callable[
    [jax.Array, LayerState, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, Aux]
]


# rngs -> a family's attention module: attn(x_BSD, cos_BSR, sin_BSR, segment_ids_BS) -> y_BSD
# for training, attn.cached(x_BSD, cos_BSR, sin_BSR, cache, start, mask_BST) -> (y_BSD, cache)
# against its own cache type for decoding (layers/attention.py's GQA, deepseek_v3's MLA).
AttentionFactory = Callable[[nnx.Rngs], Any]


class PreNormLayer(nnx.Module):
    """Pre-norm block: h = x + attn(attn_norm(x)), out = h + mlp(mlp_norm(h)); -> (out, aux).

    make_attn(rngs) builds the family's attention; mlp is a SwiGLU of width cfg.mlp_dim (a dense
    layer) or the MoE block (gmm: its grouped matmul, unused by a dense layer). Params are drawn
    in the order attn_norm, attn, mlp_norm, router, mlp."""

    def __init__(
        self,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        gmm: Gmm,
        make_attn: AttentionFactory,
        *,
        use_moe: bool,
        rngs: nnx.Rngs,
        shared_expert_gate: bool = False,
    ):
        pdt, dt = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        self.use_moe = bool(use_moe)
        self.attn_norm = RMSNorm(cfg.emb_dim, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        self.attn = make_attn(rngs)
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
                shared_expert_gate=shared_expert_gate,
            )
        else:
            std = cfg.init_std
            self.mlp = SwiGLU(
                cfg.emb_dim, cfg.mlp_dim, init_std=std, param_dtype=pdt, dtype=dt, rngs=rngs
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
        cache: Any,
        start: jax.Array,
        mask_BST: jax.Array,
    ) -> tuple[jax.Array, Any]:
        """The layer on S new tokens against its attention's cache (decoding); MoE aux is
        dropped."""
        attn_BSD, cache = self.attn.cached(
            self.attn_norm(x_BSD), cos_BSR, sin_BSR, cache, start, mask_BST
        )
        h_BSD = x_BSD + attn_BSD
        normed_BSD = self.mlp_norm(h_BSD)
        if isinstance(self.mlp, MoEBlock):
            return h_BSD + self.mlp.decode(normed_BSD), cache
        return h_BSD + self.mlp(normed_BSD), cache


def layer_step(graphdef: nnx.GraphDef[Any], policy: str, *, in_scan: bool) -> LayerStep:
    """One layer from its split state, under the remat policy (in_scan: the body of a scan)."""

    def step(
        x_BSD: jax.Array,
        state: LayerState,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None,
    ) -> tuple[jax.Array, Aux]:
        layer: PreNormLayer = nnx.merge(graphdef, state)
        return layer(x_BSD, cos_BSR, sin_BSR, segment_ids_BS)

    return remat(step, policy, in_scan=in_scan)


def check_inputs(
    tokens_BS: jax.Array, positions_BS: jax.Array | None, segment_ids_BS: jax.Array | None
) -> jax.Array:
    """A decoder's inputs checked against tokens_BS [B, S] -> positions_BS (default 0..S-1 in
    every row)."""
    if tokens_BS.ndim != 2 or not jnp.issubdtype(tokens_BS.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer [B, S], got {tokens_BS.dtype}{tokens_BS.shape}")
    b, s = tokens_BS.shape
    if positions_BS is None:
        positions_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    elif positions_BS.shape != tokens_BS.shape:
        raise ValueError(f"positions {positions_BS.shape} must match tokens {tokens_BS.shape}")
    if segment_ids_BS is not None and segment_ids_BS.shape != tokens_BS.shape:
        raise ValueError(f"segment_ids {segment_ids_BS.shape} must match tokens {tokens_BS.shape}")
    return positions_BS


def check_stack_config(cfg: ModelConfig, **dims: int) -> None:
    """The remat policy and the decoder's dimensions (vocab_size, emb_dim, num_layers,
    num_heads, mlp_dim and the family's `dims`) >= 1: a ConfigError naming the bad ones."""
    check_remat_policy(cfg.remat_policy)
    every = {
        "vocab_size": cfg.vocab_size,
        "emb_dim": cfg.emb_dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "mlp_dim": cfg.mlp_dim,
        **dims,
    }
    bad = {k: v for k, v in every.items() if v < 1}
    if bad:
        raise ConfigError(f"model dimensions must be >= 1, got {bad}")


class LayerStack(nnx.Module):
    """A decoder's embedding, layer stack, final norm and LM head, for a family's decoder to
    subclass: it sets cfg, dtype, embed, segments, final_norm and lm_head (untied), calls
    `build_layers`, defines `cos_sin` (its RoPE tables) and hands them to `run_layers`."""

    cfg: ModelConfig
    dtype: Any
    embed: nnx.Param[jax.Array]
    lm_head: nnx.Param[jax.Array]
    final_norm: RMSNorm
    segments: tuple[tuple[bool, int], ...]
    layers: nnx.List[PreNormLayer]
    stacks: nnx.List[PreNormLayer]
    # (tokens_BS, *, positions_BS=None, segment_ids_BS=None, and the family's own keywords) ->
    # (the final norm's output x_BSD in the compute dtype, aux): the decoder up to the LM head.
    hidden_states: Callable[..., tuple[jax.Array, Aux]]

    def __call__(self, tokens_BS: jax.Array, **inputs: Any) -> tuple[jax.Array, Aux]:
        """tokens_BS -> (logits_BSV float32, aux): `hidden_states(tokens_BS, **inputs)` through
        the LM head."""
        x_BSD, aux = self.hidden_states(tokens_BS, **inputs)
        return self.logits(x_BSD), aux

    def build_layers(
        self,
        make_layer: Callable[[bool, jax.Array], PreNormLayer],
        pattern: Sequence[bool],
        base_key: jax.Array,
    ) -> None:
        """Layer i is make_layer(pattern[i], fold_in(base_key, i)) in both layouts, so a scanned
        and an unrolled model built from the same seed hold the same weights (restacked):
        `stacks` (one module per run of self.segments, which must be segments(pattern)) with
        scan_layers, else `layers`."""
        if self.cfg.scan_layers:
            stacks, start = [], 0
            for use_moe, count in self.segments:
                keys = [jax.random.fold_in(base_key, i) for i in range(start, start + count)]
                stacks.append(make_stack(make_layer, use_moe, jnp.stack(keys)))
                start += count
            self.stacks = nnx.List(stacks)
        else:
            keys = [jax.random.fold_in(base_key, i) for i in range(len(pattern))]
            self.layers = nnx.List(
                [make_layer(bool(m), k) for m, k in zip(pattern, keys, strict=True)]
            )

    def embed_tokens(self, tokens_BS: jax.Array) -> jax.Array:
        """The embedding rows of tokens_BS in the compute dtype [B, S, D]."""
        return jnp.take(self.embed[...], tokens_BS, axis=0).astype(self.dtype)

    def head_VD(self) -> jax.Array:
        """The LM head's weight [V, D] in the param dtype (the embedding when tied)."""
        head_VD: jax.Array = self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]
        return head_VD

    @property
    def loss_chunk_size(self) -> int:
        """model.loss_chunk_size: vocab rows per chunk of the fused loss; 0 = the logits path."""
        return self.cfg.loss_chunk_size

    @property
    def loss_chunks(self) -> str:
        """model.loss_chunks: how the fused loss chunks (auto, vocab, tokens)."""
        return self.cfg.loss_chunks

    def logits(self, x_BSD: jax.Array) -> jax.Array:
        """The LM head on hidden states x_BSD -> logits_BSV float32."""
        # Logits come out in the compute dtype and are upcast after (MaxText's default too): an
        # f32-output bf16 matmul is ~3x slower on CPU for the [T, V] logits. The training loss
        # skips this einsum unless model.loss_chunk_size = 0 (train/loss.py).
        logits_BSV = jnp.einsum("bsd,vd->bsv", x_BSD, self.head_VD().astype(self.dtype))
        logits_BSV = logits_BSV.astype(jnp.float32)
        return constrain(logits_BSV, ("batch", "length", "vocab"))

    def run_layers(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None,
        acc: AuxAccumulator,
    ) -> jax.Array:
        """The stack on x_BSD -> x_BSD; each layer's aux goes into acc."""
        policy = self.cfg.remat_policy
        if self.cfg.scan_layers:
            for stack in self.stacks:
                graphdef, state = nnx.split(stack)
                step = layer_step(graphdef, policy, in_scan=True)

                def body(
                    x: jax.Array, st: LayerState, step: LayerStep = step
                ) -> tuple[jax.Array, Aux]:
                    return step(x, st, cos_BSR, sin_BSR, segment_ids_BS)

                x_BSD, aux_L = jax.lax.scan(body, x_BSD, state)
                acc.add_stack(aux_L)  # scan stacked the layers' aux: [L, ...]
        else:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x_BSD, aux = layer_step(graphdef, policy, in_scan=False)(
                    x_BSD, state, cos_BSR, sin_BSR, segment_ids_BS
                )
                acc.add_layer(aux)
        return x_BSD

    def stack_moe_groups(self) -> list[tuple[nnx.Module, int, bool]]:
        """The stack's MoE blocks as models/moe/layers.for_each_moe_block takes them."""
        if self.cfg.scan_layers:
            runs = zip(self.stacks, self.segments, strict=True)
            return [(stack, count, True) for stack, (is_moe, count) in runs if is_moe]
        return [(layer, 1, False) for layer in self.layers if layer.use_moe]

    def cos_sin(self, positions_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The family's RoPE tables cos, sin [B, S, R] float32 at integer positions."""
        raise NotImplementedError

    def cached(
        self,
        tokens_BS: jax.Array,
        positions_BS: jax.Array,
        caches: list[Any],
        start: jax.Array,
        first_valid_B: jax.Array,
    ) -> tuple[jax.Array, list[Any]]:
        """Decoding: S new tokens at cache slots start..start+S-1 (the same for every row; S =
        the padded prompt length at prefill, 1 per decode step) -> (logits_BSV float32, caches).

        Rows are left-padded: row b's real tokens start at slot first_valid_B[b], and a query
        at slot j sees the keys at slots first_valid_B[b]..j. positions_BS are the RoPE
        positions (slot - first_valid). caches: one per layer, the family's cache type (what
        its init_cache returns). Needs the unscanned layout (load with scan_layers off)."""
        if self.cfg.scan_layers:
            raise ValueError(
                "decoding runs the unscanned layer layout: build the model with "
                "model.scan_layers=false (checkpoint.load_params_from / moetext.generate "
                "unstack a scanned checkpoint)"
            )
        b, s = tokens_BS.shape
        length = jax.tree.leaves(caches[0])[0].shape[1]  # every cache array is [B, T, ...]
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
        # dot_rows: a batch-1 decode step is one row, which XLA:CPU would multiply by a float32
        # copy of the whole head (layers/rowdot.py); the values are __call__'s.
        logits_TV = dot_rows(
            x_TD, self.head_VD(), w_contract=1, dtype=self.dtype, out_dtype=jnp.float32
        )
        return logits_TV.reshape(b, s, -1), new_caches
