"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight), with a latent decode cache.

Legend: B batch, S query positions, T key positions (cache slots when decoding), D emb_dim,
N heads, Q q_lora_rank, C kv_lora_rank (the latent), P qk_nope_head_dim, R qk_rope_head_dim,
V v_head_dim, E = P + R (the q/k head dim).

    q      = q_b(norm(q_a(x)))  (or q_proj(x) when q_lora_rank is None)  -> [q_nope P | q_rope R]
    kv_a(x) -> [c C | k_rope R];  c = norm(c)
    k_nope = c W_uk, v = c W_uv  (kv_b, per head)
    score  = (q_nope . k_nope + rope(q_rope) . rope(k_rope)) * softmax_scale
    out    = o_proj(softmax(score) v)

k_rope is one head shared by all N. Decoding caches only c and rope(k_rope) per token
(C + R numbers, not 2 N heads) and absorbs W_uk into the query (q_nope W_uk^T, a C-vector per
head) and W_uv into the output, which makes the cached step multi-query attention over the
latent: keys [c | k_rope] and values c, one head for all N.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.models.deepseek_v3 import rope
from moetext.models.deepseek_v3.config import MLA_DIMS, check_mla_dims
from moetext.models.family import CacheArray, zeros_cache
from moetext.models.layers.attention import Kernel, attend
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal
from moetext.models.layers.project import project

# Logical axes. The low-rank dims Q (q_lora) and C, C + R (kv_lora) have names of their own;
# the presets map them to fsdp as MaxText does: a down-projection's embed takes fsdp first, so
# it is the up-projections (q_b, kv_b) that shard their rank dim.
Q_A_NAMES = ("embed", "q_lora")
Q_B_NAMES = ("q_lora", "heads", "head_dim")
Q_NAMES = ("embed", "heads", "head_dim")
KV_A_NAMES = ("embed", "kv_lora")
KV_B_NAMES = ("kv_lora", "heads", "head_dim")
O_NAMES = ("heads", "head_dim", "embed")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """One MLA layer's shape and RoPE (HF DeepseekV3Config's attention fields)."""

    emb_dim: int
    """Model width D (HF hidden_size)."""
    num_heads: int
    """Attention heads N (HF num_attention_heads)."""
    q_lora_rank: int | None
    """Rank Q of the query's low-rank path; None = one plain q projection (Moonlight)."""
    kv_lora_rank: int
    """Width C of the compressed key/value latent (what decoding caches)."""
    qk_nope_head_dim: int
    """Per-head query/key dims without RoPE (P)."""
    qk_rope_head_dim: int
    """Per-head query/key dims with RoPE (R); the key's R dims are one head shared by all."""
    v_head_dim: int
    """Per-head value dims (V)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the q_a and kv_a RMSNorms."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_interleave: bool = True
    """Rotate interleaved pairs (x0, x1), (x2, x3)... as released DeepSeek checkpoints do."""
    yarn: rope.Yarn | None = None
    """YaRN scaling of the RoPE frequencies and the softmax scale; None = plain RoPE."""
    init_std: float = 0.02
    """Standard deviation of the projections' normal init."""
    dtype: str = "float32"
    """Compute dtype."""
    param_dtype: str = "float32"
    """Parameter dtype."""
    attention_kernel: Kernel = "xla"
    """Self-attention's kernel (model.attention_kernel: auto = splash attention on TPU)."""

    def __post_init__(self) -> None:
        check_mla_dims("MLAConfig", self, ("emb_dim", "num_heads", *MLA_DIMS))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLACache(NamedTuple):
    """One MLA layer's decode cache: the normalised latent [B, T, C] and the post-RoPE shared
    key [B, T, R] of every slot, in the compute dtype."""

    latent_BTC: jax.Array
    k_rope_BTR: jax.Array


class MLA(nnx.Module):
    """Multi-head latent attention over packed rows; `cached` decodes on a latent cache."""

    def __init__(self, cfg: MLAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt, self.dtype = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        d, n, e = cfg.emb_dim, cfg.num_heads, cfg.qk_head_dim
        c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        init = normal(cfg.init_std)
        if cfg.q_lora_rank is None:
            self.w_q = make_param(rngs, init, (d, n, e), Q_NAMES, pdt)
        else:
            self.w_q_a = make_param(rngs, init, (d, cfg.q_lora_rank), Q_A_NAMES, pdt)
            self.q_a_norm = RMSNorm(
                cfg.q_lora_rank, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs
            )
            self.w_q_b = make_param(rngs, init, (cfg.q_lora_rank, n, e), Q_B_NAMES, pdt)
        self.w_kv_a = make_param(rngs, init, (d, c + r), KV_A_NAMES, pdt)
        self.kv_a_norm = RMSNorm(c, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        # kv_b as HF stores it (one [C, N, P + V] map): W_uk = [..., :P], W_uv = [..., P:].
        kv_b_shape = (c, n, cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.w_kv_b = make_param(rngs, init, kv_b_shape, KV_B_NAMES, pdt)
        self.w_o = make_param(rngs, init, (n, cfg.v_head_dim, d), O_NAMES, pdt)
        # A tuple of float32 values, static like the config (not an array in the module tree).
        self.inv_freq_h = tuple(float(f) for f in rope.inv_freq(r, cfg.rope_theta, cfg.yarn))
        self.attention_factor = 1.0 if cfg.yarn is None else rope.yarn_attention_factor(cfg.yarn)
        self.scale = rope.softmax_scale(cfg.qk_head_dim, cfg.yarn)

    def cos_sin(self, positions_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, S, R] float32 of integer positions (YaRN-scaled when configured)."""
        return rope.rope_cos_sin(positions_BS, self.inv_freq_h, self.attention_factor)

    def __call__(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        segment_ids_BS: jax.Array | None = None,
    ) -> jax.Array:
        """Causal self-attention; with segment_ids_BS a token sees only earlier tokens of its
        own segment, none of segment 0 (padding), as layers.attention.attend."""
        q_nope_BSNP, q_rope_BSNR = self._query(x_BSD, cos_BSR, sin_BSR)
        latent_BSC, k_rope_BSR = self._latent(x_BSD, cos_BSR, sin_BSR)
        p = self.cfg.qk_nope_head_dim
        w_kv_b = self.w_kv_b[...]
        k_nope_BSNP = project("bsc,cnp->bsnp", latent_BSC, w_kv_b[..., :p], KV_B_NAMES, self.dtype)
        v_BSNV = project("bsc,cnv->bsnv", latent_BSC, w_kv_b[..., p:], KV_B_NAMES, self.dtype)
        k_rope_BSNR = jnp.broadcast_to(k_rope_BSR[:, :, None, :], q_rope_BSNR.shape)
        q_BSNE = jnp.concatenate([q_nope_BSNP, q_rope_BSNR], axis=-1)
        k_BSNE = jnp.concatenate([k_nope_BSNP, k_rope_BSNR], axis=-1)
        out_BSNV = attend(
            q_BSNE,
            k_BSNE,
            v_BSNV,
            segment_ids_BS,
            scale=self.scale,
            kernel=self.cfg.attention_kernel,
        )
        return project("bsnv,nvd->bsd", out_BSNV, self.w_o[...], O_NAMES, self.dtype)

    def _query(
        self, x_BSD: jax.Array, cos_BSR: jax.Array, sin_BSR: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """-> (q_nope [B, S, N, P], post-RoPE q_rope [B, S, N, R])."""
        x = x_BSD.astype(self.dtype)
        if self.cfg.q_lora_rank is None:
            q_BSNE = project("bsd,dne->bsne", x, self.w_q[...], Q_NAMES, self.dtype)
        else:
            q_BSQ = project("bsd,dq->bsq", x, self.w_q_a[...], Q_A_NAMES, self.dtype)
            q_BSQ = self.q_a_norm(q_BSQ)
            q_BSNE = project("bsq,qne->bsne", q_BSQ, self.w_q_b[...], Q_B_NAMES, self.dtype)
        p = self.cfg.qk_nope_head_dim
        interleave = self.cfg.rope_interleave
        q_rope_BSNR = rope.apply_mla_rope(q_BSNE[..., p:], cos_BSR, sin_BSR, interleave=interleave)
        return q_BSNE[..., :p], q_rope_BSNR

    def _latent(
        self, x_BSD: jax.Array, cos_BSR: jax.Array, sin_BSR: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """-> (normalised latent [B, S, C], post-RoPE shared key [B, S, R])."""
        x = x_BSD.astype(self.dtype)
        kv_BSF = project("bsd,df->bsf", x, self.w_kv_a[...], KV_A_NAMES, self.dtype)
        c = self.cfg.kv_lora_rank
        latent_BSC = self.kv_a_norm(kv_BSF[..., :c])
        k_rope_BS1R = rope.apply_mla_rope(
            kv_BSF[:, :, None, c:], cos_BSR, sin_BSR, interleave=self.cfg.rope_interleave
        )
        return latent_BSC, k_rope_BS1R[:, :, 0]

    def cache_spec(self, batch: int, length: int) -> MLACache:
        """The decode cache of `batch` rows and `length` slots, as CacheArray (not allocated)."""
        names = ("batch", None, None)
        dtype = str(jnp.dtype(self.dtype))
        latent: Any = CacheArray((batch, length, self.cfg.kv_lora_rank), dtype, names)
        k_rope: Any = CacheArray((batch, length, self.cfg.qk_rope_head_dim), dtype, names)
        return MLACache(latent, k_rope)

    def init_cache(self, batch: int, length: int) -> MLACache:
        """A zero cache of `batch` rows and `length` slots."""
        cache: MLACache = zeros_cache(self.cache_spec(batch, length))
        return cache

    def cached(
        self,
        x_BSD: jax.Array,
        cos_BSR: jax.Array,
        sin_BSR: jax.Array,
        cache: MLACache,
        start: jax.Array,
        mask_BST: jax.Array,
    ) -> tuple[jax.Array, MLACache]:
        """Attention of S new tokens written at cache slots start..start+S-1 (the same for
        every row) over the cache's T slots, visible ones given by mask_BST (as
        layers.attention.Attention.cached). No per-head key or value is formed: W_uk goes into
        the query and W_uv onto the output, the cache stays [B, T, C + R]."""
        q_nope_BSNP, q_rope_BSNR = self._query(x_BSD, cos_BSR, sin_BSR)
        latent_BSC, k_rope_BSR = self._latent(x_BSD, cos_BSR, sin_BSR)
        latent_BTC = jax.lax.dynamic_update_slice(
            cache.latent_BTC, latent_BSC.astype(cache.latent_BTC.dtype), (0, start, 0)
        )
        k_rope_BTR = jax.lax.dynamic_update_slice(
            cache.k_rope_BTR, k_rope_BSR.astype(cache.k_rope_BTR.dtype), (0, start, 0)
        )
        p = self.cfg.qk_nope_head_dim
        w_kv_b = self.w_kv_b[...].astype(self.dtype)
        # q_nope . (c W_uk) = (q_nope W_uk^T) . c: the query moves into the latent space.
        q_lat_BSNC = jnp.einsum("bsnp,cnp->bsnc", q_nope_BSNP, w_kv_b[..., :p])
        q_BSNF = jnp.concatenate([q_lat_BSNC, q_rope_BSNR.astype(self.dtype)], axis=-1)
        k_BT1F = jnp.concatenate([latent_BTC, k_rope_BTR], axis=-1)[:, :, None, :]
        # One kv head for all N (multi-query): the latent is each head's key and value.
        out_lat_BSNC = attend(
            q_BSNF, k_BT1F, latent_BTC[:, :, None, :], mask_BST=mask_BST, scale=self.scale
        )
        out_BSNV = jnp.einsum("bsnc,cnv->bsnv", out_lat_BSNC, w_kv_b[..., p:])
        out_BSD = jnp.einsum("bsnv,nvd->bsd", out_BSNV, self.w_o[...].astype(self.dtype))
        return out_BSD, MLACache(latent_BTC, k_rope_BTR)
