"""Grouped-query causal self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3).

Legend: B batch, S query positions, T key positions, D emb_dim, N query heads, K kv heads,
G = N // K query heads per kv head, H head_dim (of q and k), V v's head dim (H unless given).
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetext.config.schema import ModelConfig
from moetext.kernels.pallas import target
from moetext.models.layers import splash
from moetext.models.layers.norms import RMSNorm
from moetext.models.layers.params import as_dtype, make_param, normal, zeros
from moetext.models.layers.project import project
from moetext.models.layers.rope import apply_rope
from moetext.models.layers.rowdot import dot_rows

# Self-attention over more than this many queries runs a block of queries at a time (see
# `attend`): the [B, K, G, S, T] f32 scores and their gradient are never whole.
QUERY_BLOCK = 512
# Logical axes of the projections.
Q_NAMES = ("embed", "heads", "head_dim")
KV_NAMES = ("embed", "kv_heads", "head_dim")
O_NAMES = ("heads", "head_dim", "embed")

Kernel = Literal["auto", "xla", "splash"]
_log = logging.getLogger(__name__)


def splash_wanted(kernel: Kernel) -> bool:
    """Whether `kernel` (model.attention_kernel) asks for splash attention: "splash" always,
    "auto" when the code runs on, or is compiled ahead of time for, a TPU."""
    if kernel not in ("auto", "xla", "splash"):
        raise ValueError(f"attention kernel must be one of auto, xla, splash; got {kernel!r}")
    if kernel == "auto":
        return target.tpu_code()
    return kernel == "splash"


def attend(
    q_BSNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    segment_ids_BS: jax.Array | None = None,
    *,
    mask_BST: jax.Array | None = None,
    scale: float | None = None,
    kernel: Kernel = "xla",
) -> jax.Array:
    """Causal GQA softmax(q k^T * scale) v with f32 scores; returns [B, S, N, V] in v's dtype.

    scale defaults to 1 / sqrt(H); v may have another head dim than q and k (DeepSeek's MLA).

    Causality is by index (query s sees keys t <= s); positions only feed RoPE. With
    segment_ids_BS (self-attention, S == T) a query also sees only keys of its own segment,
    and no key of segment 0 (padding); a padding query sees nothing (its output is junk that
    the loss masks out). An explicit mask_BST (True: query s may see key t) replaces both, as
    decoding with a KV cache needs (keys are cache slots, not the queries' own positions).

    Self-attention over S > QUERY_BLOCK queries (S a multiple of it) loops over blocks of
    queries, each rematerialised in the backward pass: every query row is computed exactly as
    in one piece (its whole key row, the same softmax), but the f32 scores of only one block
    exist at a time ([B, N, QUERY_BLOCK, T] instead of [B, N, S, T]; 2 GiB -> 256 MiB per chip
    and layer for Qwen3-30B-A3B at 4096 tokens per chip).

    kernel (`splash_wanted`): "splash" or "auto" on TPU run self-attention through Pallas splash
    attention (models/layers/splash.py: no score block in HBM, causal blocks skipped) when
    its shapes fit; decoding with mask_BST, and shapes it cannot take, stay on the XLA code here.
    """
    if mask_BST is None and splash_wanted(kernel):
        reason = splash.unfit_reason(q_BSNH, k_BTKH, v_BTKH)
        if reason is None:
            return splash.splash_attend(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, scale=scale)
        # Asked for by name: a warning; by auto (short test sequences on TPU): a note.
        level = logging.WARNING if kernel == "splash" else logging.INFO
        _log.log(level, "attention stays on XLA, not splash: %s", reason)
    s, t = q_BSNH.shape[1], k_BTKH.shape[1]
    if mask_BST is not None or s != t or s <= QUERY_BLOCK or s % QUERY_BLOCK:
        return _attend_rows(q_BSNH, k_BTKH, v_BTKH, segment_ids_BS, mask_BST, 0, scale)
    b, _, n, h = q_BSNH.shape
    blocks = s // QUERY_BLOCK
    q_CBQNH = jnp.moveaxis(q_BSNH.reshape(b, blocks, QUERY_BLOCK, n, h), 1, 0)

    @jax.checkpoint
    def block(c: jax.Array, q_BQNH: jax.Array) -> jax.Array:
        return _attend_rows(q_BQNH, k_BTKH, v_BTKH, segment_ids_BS, None, c * QUERY_BLOCK, scale)

    def step(c: jax.Array, q_BQNH: jax.Array) -> tuple[jax.Array, jax.Array]:
        return c + 1, block(c, q_BQNH)

    _, out_CBQNH = jax.lax.scan(step, jnp.zeros((), jnp.int32), q_CBQNH)
    return jnp.moveaxis(out_CBQNH, 0, 1).reshape(b, s, n, v_BTKH.shape[-1])


def _attend_rows(
    q_BSNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    segment_ids_BT: jax.Array | None,
    mask_BST: jax.Array | None,
    first: jax.Array | int,
    scale: float | None,
) -> jax.Array:
    """`attend` for the S queries at positions first .. first + S - 1 of the T keys
    (self-attention when segment_ids_BT is given: the keys' segments, the queries' among them)."""
    b, s, n, h = q_BSNH.shape
    kv = k_BTKH.shape[2]
    q_BSKGH = q_BSNH.reshape(b, s, kv, n // kv, h)
    scores_BKGST = jnp.einsum(
        "bskgh,btkh->bkgst", q_BSKGH, k_BTKH, preferred_element_type=jnp.float32
    )
    if scale is None:
        scores_BKGST = scores_BKGST / jnp.sqrt(jnp.float32(h))
    else:
        scores_BKGST = scores_BKGST * jnp.float32(scale)
    t = k_BTKH.shape[1]
    rows_S = first + jnp.arange(s)
    causal_ST = rows_S[:, None] >= jnp.arange(t)[None, :]
    mask = causal_ST
    if mask_BST is not None:
        mask = mask_BST[:, None, None]
    elif segment_ids_BT is not None:
        q_seg_BS1 = jax.lax.dynamic_slice_in_dim(segment_ids_BT, first, s, axis=1)[:, :, None]
        k_seg_B1T = segment_ids_BT[:, None, :]
        mask_BST = causal_ST & (q_seg_BS1 == k_seg_B1T) & (k_seg_B1T != 0)
        mask = mask_BST[:, None, None]  # [B, 1, 1, S, T]: fused into the select below
    # A large finite negative (not -inf) keeps fully masked rows NaN-free under autodiff.
    scores_BKGST = jnp.where(mask, scores_BKGST, np.finfo(np.float32).min)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKH.dtype)
    out_BSKGV = jnp.einsum("bkgst,btkv->bskgv", probs_BKGST, v_BTKH)
    return out_BSKGV.reshape(b, s, n, v_BTKH.shape[-1])


class Attention(nnx.Module):
    """GQA self-attention with RoPE; qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3);
    bias: a bias on the q, k and v projections (Qwen2). The family decides both."""

    def __init__(
        self, cfg: ModelConfig, *, qk_norm: bool = False, bias: bool = False, rngs: nnx.Rngs
    ):
        if cfg.num_kv_heads <= 0 or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(
                f"num_heads={cfg.num_heads} must be a positive multiple of "
                f"num_kv_heads={cfg.num_kv_heads}"
            )
        pdt, self.dtype = as_dtype(cfg.param_dtype), as_dtype(cfg.dtype)
        d, n, kv, h = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = normal(cfg.init_std)
        self.w_q = make_param(rngs, init, (d, n, h), Q_NAMES, pdt)
        self.w_k = make_param(rngs, init, (d, kv, h), KV_NAMES, pdt)
        self.w_v = make_param(rngs, init, (d, kv, h), KV_NAMES, pdt)
        self.w_o = make_param(rngs, init, (n, h, d), O_NAMES, pdt)
        self.bias = bias
        if self.bias:  # Qwen2(-MoE): q, k, v projections with bias (zeros at init)
            self.b_q = make_param(rngs, zeros, (n, h), ("heads", "head_dim"), pdt)
            self.b_k = make_param(rngs, zeros, (kv, h), ("kv_heads", "head_dim"), pdt)
            self.b_v = make_param(rngs, zeros, (kv, h), ("kv_heads", "head_dim"), pdt)
        self.kernel: Kernel = cfg.attention_kernel
        self.qk_norm = qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)
            self.k_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=pdt, rngs=rngs)

    def __call__(
        self,
        x_BSD: jax.Array,
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        segment_ids_BS: jax.Array | None = None,
    ) -> jax.Array:
        q_BSNH, k_BSKH, v_BSKH = self._qkv(x_BSD, cos_BSH, sin_BSH)
        out_BSNH = attend(q_BSNH, k_BSKH, v_BSKH, segment_ids_BS, kernel=self.kernel)
        return project("bsnh,nhd->bsd", out_BSNH, self.w_o[...], O_NAMES, self.dtype)

    def _project_rows(self, x_BSI: jax.Array, w: jax.Array, contract: int) -> jax.Array:
        """x_BSI @ w over w's first `contract` axes (the I ones) as a 2-D `dot_rows`, for
        decoding: a one-token step would otherwise take XLA:CPU's float32 path (rowdot.py)."""
        b, s = x_BSI.shape[:2]
        w_IO = w.reshape(int(np.prod(w.shape[:contract])), -1)
        y = dot_rows(
            x_BSI.reshape(b * s, -1), w_IO, w_contract=0, dtype=self.dtype, out_dtype=self.dtype
        )
        return y.reshape(b, s, *w.shape[contract:])

    def _qkv(
        self, x_BSD: jax.Array, cos_BSH: jax.Array, sin_BSH: jax.Array, rows: bool = False
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = x_BSD.astype(self.dtype)
        if rows:
            q_BSNH = self._project_rows(x, self.w_q[...], 1)
            k_BSKH = self._project_rows(x, self.w_k[...], 1)
            v_BSKH = self._project_rows(x, self.w_v[...], 1)
        else:
            q_BSNH = project("bsd,dnh->bsnh", x, self.w_q[...], Q_NAMES, self.dtype)
            k_BSKH = project("bsd,dkh->bskh", x, self.w_k[...], KV_NAMES, self.dtype)
            v_BSKH = project("bsd,dkh->bskh", x, self.w_v[...], KV_NAMES, self.dtype)
        if self.bias:
            q_BSNH = q_BSNH + self.b_q[...].astype(self.dtype)
            k_BSKH = k_BSKH + self.b_k[...].astype(self.dtype)
            v_BSKH = v_BSKH + self.b_v[...].astype(self.dtype)
        if self.qk_norm:
            q_BSNH, k_BSKH = self.q_norm(q_BSNH), self.k_norm(k_BSKH)
        return apply_rope(q_BSNH, cos_BSH, sin_BSH), apply_rope(k_BSKH, cos_BSH, sin_BSH), v_BSKH

    def cached(
        self,
        x_BSD: jax.Array,
        cos_BSH: jax.Array,
        sin_BSH: jax.Array,
        cache: KVCache,
        start: jax.Array,
        mask_BST: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """Attention of S new tokens written at cache slots start..start+S-1 (the same slots
        for every row) over the cache's T slots, visible ones given by mask_BST. The cache holds
        only the K kv heads (GQA), post-RoPE keys."""
        q_BSNH, k_BSKH, v_BSKH = self._qkv(x_BSD, cos_BSH, sin_BSH, rows=True)
        k_BTKH = jax.lax.dynamic_update_slice(
            cache.k_BTKH, k_BSKH.astype(cache.k_BTKH.dtype), (0, start, 0, 0)
        )
        v_BTKH = jax.lax.dynamic_update_slice(
            cache.v_BTKH, v_BSKH.astype(cache.v_BTKH.dtype), (0, start, 0, 0)
        )
        out_BSNH = attend(q_BSNH, k_BTKH, v_BTKH, mask_BST=mask_BST)
        b, s, n, h = out_BSNH.shape
        out = self._project_rows(out_BSNH.reshape(b, s, n * h), self.w_o[...], 2)
        return out, KVCache(k_BTKH, v_BTKH)


class KVCache(NamedTuple):
    """One attention layer's cache: post-RoPE keys and values of the kv heads, [B, T, K, H]."""

    k_BTKH: jax.Array
    v_BTKH: jax.Array
