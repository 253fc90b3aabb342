"""DeepSeek multi-head latent attention against a float64 NumPy reference; YaRN against a
transcription of transformers' formulas; latent-cache decoding against the uncached forward.

The layer's modules are imported directly (the family folder's own package; tests may); the
whole decoder is tests/models/test_deepseek_v3.py's.

Tolerances: the layer runs in float32 and the reference in float64 on O(1) activations with
tiny contractions (at most 32 terms), so float32 rounding is ~1e-6 of the values: 1e-5 max-abs.
Decoding reassociates the same float32 sums (q_nope W_uk^T . c instead of q_nope . c W_uk):
1e-5 max-abs as well.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moetext.models.deepseek_v3 import rope
from moetext.models.deepseek_v3.mla import MLA, MLAConfig
from moetext.models.layers import attention
from moetext.sharding.rules import available_presets, load_preset

SHAPES = dict(emb_dim=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8)
# Blends the ramp at R = 8: correction range (1, 3); attention factor != 1 (mscale differ).
SMALL_YARN = rope.Yarn(
    factor=4.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.5
)


# --- NumPy float64 reference, transcribed from transformers (modeling_rope_utils.py and
# models/deepseek_v3/modeling_deepseek_v3.py) -----------------------------------------------


def np_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def np_yarn(dim, base, y):
    """(inv_freq, attention_factor, (low, high)) as _compute_yarn_parameters, in float64."""
    if y.mscale and y.mscale_all_dim:
        attention_factor = np_mscale(y.factor, y.mscale) / np_mscale(y.factor, y.mscale_all_dim)
    else:
        attention_factor = np_mscale(y.factor)
    ctx = y.original_max_position_embeddings

    def corr(rot):
        return (dim * math.log(ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr(y.beta_fast)), 0)
    high = min(math.ceil(corr(y.beta_slow)), dim - 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip(
        (np.arange(dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1
    )
    extra = 1 - ramp
    inv = (1 / (y.factor * pos_freqs)) * (1 - extra) + (1 / pos_freqs) * extra
    return inv, attention_factor, (low, high)


def np_rope(x, pos, dim, base, yarn, interleave):
    """x [..., S, R] rotated at positions pos [S] (apply_rotary_pos_emb[_interleave])."""
    if yarn is None:
        inv, af = 1 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim), 1.0
    else:
        inv, af, _ = np_yarn(dim, base, yarn)
    freqs = pos[:, None].astype(np.float64) * inv
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb) * af, np.sin(emb) * af
    if interleave:
        x = np.concatenate([x[..., 0::2], x[..., 1::2]], -1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_mla(p, cfg, x, pos, seg):
    """One row: x [S, D], RoPE positions pos [S], segment ids seg [S] -> [S, D] float64."""
    n, pd, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        q = np.einsum("sd,dne->nse", x, p["w_q"])
    else:
        qa = np_rms(x @ p["w_q_a"], p["q_a_norm"], cfg.rms_norm_eps)
        q = np.einsum("sq,qne->nse", qa, p["w_q_b"])
    kv = x @ p["w_kv_a"]
    c = np_rms(kv[:, : cfg.kv_lora_rank], p["kv_a_norm"], cfg.rms_norm_eps)
    kvb = np.einsum("sc,cnf->nsf", c, p["w_kv_b"])
    k_nope, v = kvb[..., :pd], kvb[..., pd:]
    rot = dict(pos=pos, dim=r, base=cfg.rope_theta, yarn=cfg.yarn, interleave=cfg.rope_interleave)
    q_rope = np_rope(q[..., pd:], **rot)
    k_rope = np_rope(kv[None, :, cfg.kv_lora_rank :], **rot)
    q = np.concatenate([q[..., :pd], q_rope], -1)
    k = np.concatenate([k_nope, np.broadcast_to(k_rope, (n, *k_rope.shape[1:]))], -1)
    scale = cfg.qk_head_dim**-0.5
    if cfg.yarn is not None and cfg.yarn.mscale_all_dim:
        scale *= np_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2
    scores = np.einsum("nse,nte->nst", q, k) * scale
    s = len(x)
    allowed = (np.arange(s)[:, None] >= np.arange(s)[None]) & (seg[:, None] == seg[None])
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("nst,ntv->snv", probs, v)
    return np.einsum("snv,nvd->sd", out, p["w_o"])


def make_layer(cfg, seed=0):
    layer = MLA(cfg, rngs=nnx.Rngs(params=seed))
    # Random norm scales, so the reference checks they are applied (they start at ones).
    key = jax.random.key(seed + 100)
    for i, norm in enumerate([getattr(layer, "q_a_norm", None), layer.kv_a_norm]):
        if norm is not None:
            shape = norm.scale[...].shape
            norm.scale[...] = 1 + 0.5 * jax.random.normal(jax.random.fold_in(key, i), shape)
    return layer


def np_params(layer):
    names = ["w_q", "w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_o"]
    p = {k: np.asarray(getattr(layer, k)[...], np.float64) for k in names if hasattr(layer, k)}
    p["kv_a_norm"] = np.asarray(layer.kv_a_norm.scale[...], np.float64)
    if hasattr(layer, "q_a_norm"):
        p["q_a_norm"] = np.asarray(layer.q_a_norm.scale[...], np.float64)
    return p


def config(q_lora, yarn, interleave, **kw):
    return MLAConfig(
        **SHAPES,
        q_lora_rank=24 if q_lora else None,
        v_head_dim=12,  # != P + R: the kernel's v head dim differs from q/k's
        rope_interleave=interleave,
        yarn=SMALL_YARN if yarn else None,
        init_std=0.2,
        **kw,
    )


# --- the layer against the reference --------------------------------------------------------


@pytest.mark.parametrize(
    "q_lora, yarn, interleave",
    [(True, True, True), (False, True, False), (True, False, False), (False, False, True)],
)
def test_forward_matches_numpy_reference_on_packed_rows(q_lora, yarn, interleave):
    cfg = config(q_lora, yarn, interleave)
    layer = make_layer(cfg)
    # Row 0: three documents; row 1: one document then padding (segment 0).
    seg_BS = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    pos_BS = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]]) * 3
    x_BSD = np.asarray(jax.random.normal(jax.random.key(7), (2, 10, cfg.emb_dim)))
    cos, sin = layer.cos_sin(jnp.asarray(pos_BS))
    got = np.asarray(forward(layer, jnp.asarray(x_BSD), cos, sin, jnp.asarray(seg_BS)))
    p = np_params(layer)
    for b in range(2):
        want = np_mla(p, cfg, x_BSD[b].astype(np.float64), pos_BS[b], seg_BS[b])
        real = seg_BS[b] != 0  # padding rows' outputs are junk the loss masks out
        assert np.abs(want[real]).max() > 0.1  # O(1) outputs: the tolerance is meaningful
        np.testing.assert_allclose(got[b][real], want[real], rtol=0, atol=1e-5)


def test_rope_interleave_reorders_pairs_before_rotating():
    x = jnp.arange(8.0).reshape(1, 1, 1, 8)
    assert rope.deinterleave(x).ravel().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    pos = jnp.array([[3]])
    cos, sin = rope.rope_cos_sin(pos, rope.inv_freq(8, 100.0, None))
    want = np_rope(np.arange(8.0)[None], np.array([3]), 8, 100.0, None, True)
    got = rope.apply_mla_rope(x, cos, sin, interleave=True)
    np.testing.assert_allclose(np.asarray(got).reshape(1, 8), want, rtol=0, atol=1e-5)


# --- YaRN with DeepSeek-V3's published rope_scaling --------------------------------------------

DEEPSEEK_V3_YARN = rope.Yarn(
    factor=40,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def test_yarn_frequencies_and_scales_match_transformers_formulas():
    y, dim, base = DEEPSEEK_V3_YARN, 64, 10000.0
    want_inv, want_af, want_range = np_yarn(dim, base, y)
    # The correction range by hand: 64 ln(4096 / (32 * 2 pi)) / (2 ln 1e4) = 10.47 -> 10;
    # 64 ln(4096 / (2 pi)) / (2 ln 1e4) = 22.51 -> 23.
    assert want_range == (10, 23) == rope.yarn_correction_range(y, dim, base)
    got = rope.inv_freq(dim, base, y)
    assert got.dtype == np.float32 and got.shape == (32,)
    # float32 (transformers' dtype) vs float64: a few float32 ulps (2^-24 = 6e-8 each).
    np.testing.assert_allclose(got, want_inv, rtol=5e-7, atol=0)
    # Dims below the range keep theta^(-2i/R); above it they are divided by the factor.
    np.testing.assert_allclose(got[:10], base ** (-np.arange(0, 20, 2) / 64), rtol=1e-6)
    np.testing.assert_allclose(got[23:], base ** (-np.arange(46, 64, 2) / 64) / 40, rtol=1e-6)
    # mscale == mscale_all_dim: cos/sin unscaled; the softmax scale carries mscale^2.
    assert rope.yarn_attention_factor(y) == want_af == 1.0
    m = 0.1 * math.log(40) + 1.0  # 1.368888; m^2 = 1.873854
    assert rope.softmax_scale(192, y) == pytest.approx(192**-0.5 * m * m, rel=1e-15)
    assert rope.softmax_scale(192, y) == pytest.approx(0.135234, abs=1e-6)  # 0.0721688 m^2
    assert rope.softmax_scale(192, None) == 192**-0.5


def test_yarn_attention_factor_rules():
    # mscale without mscale_all_dim: the paper's 0.1 ln(s) + 1 on cos/sin, no softmax fold.
    y = rope.Yarn(factor=40, original_max_position_embeddings=4096)
    assert rope.yarn_attention_factor(y) == pytest.approx(0.1 * math.log(40) + 1)
    assert rope.softmax_scale(192, y) == 192**-0.5
    assert rope.yarn_attention_factor(SMALL_YARN) == pytest.approx(
        (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    )
    explicit = rope.Yarn(factor=40, original_max_position_embeddings=4096, attention_factor=0.5)
    assert rope.yarn_attention_factor(explicit) == 0.5


# --- decoding on the latent cache ----------------------------------------------------------------


@nnx.jit
def cached(layer, x_BSD, cos, sin, cache, start, mask_BST):
    return layer.cached(x_BSD, cos, sin, cache, start, mask_BST)


@nnx.jit
def forward(layer, x_BSD, cos, sin, segment_ids_BS=None):
    return layer(x_BSD, cos, sin, segment_ids_BS)


def test_cached_decode_matches_uncached_forward():
    """Prefill of left-padded prompts (lengths 5 and 3 in 5 slots), then 3 one-token steps: the
    cached outputs equal the uncached layer on each row's real tokens."""
    cfg = config(q_lora=True, yarn=True, interleave=True)
    layer = make_layer(cfg, seed=3)
    lengths, prompt, steps, slots = [5, 3], 5, 3, 9
    x_BLD = jax.random.normal(jax.random.key(11), (2, prompt + steps, cfg.emb_dim))
    first_valid_B = jnp.array([prompt - n for n in lengths])
    cache = layer.init_cache(2, slots)
    assert cache.latent_BTC.shape == (2, slots, 16) and cache.k_rope_BTR.shape == (2, slots, 8)
    t_T = jnp.arange(slots)
    outs = []
    for start, s in [(0, prompt)] + [(prompt + i, 1) for i in range(steps)]:
        slots_S = start + jnp.arange(s)
        mask_BST = (t_T[None, None, :] <= slots_S[None, :, None]) & (
            t_T[None, None, :] >= first_valid_B[:, None, None]
        )
        positions_BS = jnp.maximum(slots_S[None, :] - first_valid_B[:, None], 0)
        cos, sin = layer.cos_sin(positions_BS)
        x_BSD = x_BLD[:, start : start + s]
        out, cache = cached(layer, x_BSD, cos, sin, cache, jnp.int32(start), mask_BST)
        outs.append(out)
    got_BLD = np.asarray(jnp.concatenate(outs, axis=1))
    for b, n in enumerate(lengths):
        real = x_BLD[b : b + 1, prompt - n :]
        pos = jnp.arange(real.shape[1])[None]
        want = np.asarray(forward(layer, real, *layer.cos_sin(pos)))[0]
        np.testing.assert_allclose(got_BLD[b, prompt - n :], want, rtol=0, atol=1e-5)
        assert np.abs(want).max() > 0.1


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(**{**SHAPES, "qk_rope_head_dim": 7}, q_lora_rank=None, v_head_dim=4)
    with pytest.raises(ValueError, match="q_lora_rank"):
        MLAConfig(**SHAPES, q_lora_rank=0, v_head_dim=4)
    with pytest.raises(ValueError, match="yarn factor"):
        rope.Yarn(factor=0, original_max_position_embeddings=4096)


def test_blocked_attention_path_takes_v_head_dim(monkeypatch):
    """Long rows run `attend` a block of queries at a time; with V != P + R the blocked path
    gives the one-piece result."""
    cfg = config(q_lora=False, yarn=False, interleave=True)
    layer = make_layer(cfg)
    x_BSD = jax.random.normal(jax.random.key(5), (1, 8, cfg.emb_dim))
    seg_BS = jnp.array([[1, 1, 1, 1, 1, 2, 2, 0]])
    cos, sin = layer.cos_sin(jnp.arange(8)[None])
    whole = np.asarray(layer(x_BSD, cos, sin, seg_BS))
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    blocked = np.asarray(layer(x_BSD, cos, sin, seg_BS))
    # Same rows, same softmax, another program (a scan): float32 rounding only.
    np.testing.assert_allclose(blocked[:, :7], whole[:, :7], rtol=0, atol=1e-6)


def test_gradients_reach_every_parameter_and_axes_are_preset_names():
    cfg = config(q_lora=True, yarn=True, interleave=True)
    layer = make_layer(cfg)
    x_BSD = jax.random.normal(jax.random.key(2), (1, 6, cfg.emb_dim))
    seg_BS = jnp.array([[1, 1, 1, 2, 2, 0]])
    cos, sin = layer.cos_sin(jnp.array([[0, 1, 2, 0, 1, 0]]))

    def loss(m):
        return jnp.sum(m(x_BSD, cos, sin, seg_BS) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, path
    # Every logical name is one the shipped sharding presets map (None: replicated).
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert tuple(specs["w_q_a"].get_value()) == ("embed", "q_lora")
    assert tuple(specs["w_q_b"].get_value()) == ("q_lora", "heads", "head_dim")
    assert tuple(specs["w_kv_a"].get_value()) == ("embed", "kv_lora")
    assert tuple(specs["w_kv_b"].get_value()) == ("kv_lora", "heads", "head_dim")
    assert tuple(specs["w_o"].get_value()) == ("heads", "head_dim", "embed")
    known = {"embed", "heads", "head_dim", "q_lora", "kv_lora", "norm", None}
    for preset in available_presets():  # every shipped preset maps them
        assert known - {None} <= {name for name, _ in load_preset(preset).rules}, preset
    leaves = jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert len(leaves) == 7  # q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o
    for leaf in leaves:
        assert set(leaf.get_value()) <= known, leaf


def test_splash_attention_kernel_gives_the_xla_rows():
    """model.attention_kernel reaches MLA (mla_config reads it by name): splash attention, here
    through Pallas' interpreter, gives the XLA path's rows with V != P + R (packed segments)."""
    kw = dict(q_lora=True, yarn=True, interleave=True)
    xla = make_layer(config(**kw))
    splash = make_layer(config(**kw, attention_kernel="splash"))
    x_BSD = jax.random.normal(jax.random.key(3), (1, 128, xla.cfg.emb_dim))
    seg_BS = jnp.concatenate([jnp.ones((1, 60), jnp.int32), jnp.full((1, 68), 2, jnp.int32)], 1)
    cos, sin = xla.cos_sin(jnp.concatenate([jnp.arange(60), jnp.arange(68)])[None])
    want = np.asarray(xla(x_BSD, cos, sin, seg_BS))
    got = np.asarray(splash(x_BSD, cos, sin, seg_BS))
    jaxpr = str(jax.make_jaxpr(lambda x: splash(x, cos, sin, seg_BS))(x_BSD))
    assert "pallas_call" in jaxpr and "pallas_call" not in str(
        jax.make_jaxpr(lambda x: xla(x, cos, sin, seg_BS))(x_BSD)
    )
    # float32, the same products summed in other orders (splash's online softmax): ~1e-6.
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
