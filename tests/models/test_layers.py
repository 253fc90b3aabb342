"""RMSNorm, RoPE, GQA attention and SwiGLU against float64 NumPy oracles.

All modules run with float32 compute here; float32 has ~1.2e-7 relative precision and these
tiny problems (sums of <= 64 terms of O(1) values) accumulate well under 1e-5 relative error, so
the oracle comparisons use rtol = atol = 1e-5 unless stated.
"""

import jax
import jax.numpy as jnp
import np_ref
import numpy as np
import pytest
from flax import nnx

from moetext.config.schema import ModelConfig
from moetext.models.layers import Attention, SwiGLU, apply_rope, attention, rms_norm, rope_cos_sin

TOL = dict(rtol=1e-5, atol=1e-5)


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_reference_and_keeps_dtype():
    x, scale = _rand(0, 2, 3, 16), _rand(1, 16)
    out = rms_norm(jnp.asarray(x), jnp.asarray(scale), 1e-6)
    np.testing.assert_allclose(out, np_ref.rms_norm(x, scale, 1e-6), **TOL)
    out_bf16 = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale), 1e-6)
    assert out_bf16.dtype == jnp.bfloat16


def test_rope_matches_reference_at_offset_positions():
    x = _rand(2, 2, 5, 3, 8)
    pos = np.arange(5)[None, :] + np.array([[0], [7]])  # second row starts at position 7
    cos, sin = rope_cos_sin(jnp.asarray(pos), 8, 10_000.0)
    out = apply_rope(jnp.asarray(x), cos, sin)
    np.testing.assert_allclose(out, np_ref.rope(x, pos, 10_000.0), **TOL)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        rope_cos_sin(jnp.zeros((1, 2), jnp.int32), 7, 10_000.0)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_matches_float64_reference(qk_norm):
    # GQA with 2 query heads per kv head, RoPE at non-zero start positions, causal mask.
    cfg = ModelConfig(
        emb_dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        init_std=0.3,
        rope_theta=10_000.0,
    )
    attn = Attention(cfg, qk_norm=qk_norm, rngs=nnx.Rngs(params=0))
    if qk_norm:  # non-trivial norm scales so the test sees them
        attn.q_norm.scale[...] = jnp.asarray(1.0 + 0.1 * _rand(5, 8))
        attn.k_norm.scale[...] = jnp.asarray(1.0 - 0.1 * _rand(6, 8))
    x = _rand(3, 2, 6, 32)
    pos = np.arange(6)[None, :] + np.array([[0], [4]])
    cos, sin = rope_cos_sin(jnp.asarray(pos), 8, cfg.rope_theta)
    out = attn(jnp.asarray(x), cos, sin)
    scales = (attn.q_norm.scale[...], attn.k_norm.scale[...]) if qk_norm else (None, None)
    ref = np_ref.attention(
        x,
        attn.w_q[...],
        attn.w_k[...],
        attn.w_v[...],
        attn.w_o[...],
        *scales,
        cfg.rms_norm_eps,
        cfg.rope_theta,
        pos,
    )
    assert out.shape == (2, 6, 32) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("query_block", [None, 3])
def test_attention_with_segment_ids_equals_each_segment_alone(monkeypatch, query_block):
    # A packed row [doc 1 (3 tokens) | doc 2 (4 tokens) | padding (2)] next to a row of one
    # document; each document's positions restart at 0 and its output must be that of the
    # document run alone (float64 oracle on the slice). Padding queries see no key: their output
    # is junk, only required to be finite. float32 against float64: measured max|err| / max|ref|
    # <= 1.5e-7 per document; bound 1e-6. query_block=3: the 9 queries in 3 blocks of 3, the
    # second straddling both documents.
    if query_block is not None:
        monkeypatch.setattr(attention, "QUERY_BLOCK", query_block)
    cfg = ModelConfig(
        emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", init_std=0.3
    )
    attn = Attention(cfg, qk_norm=True, rngs=nnx.Rngs(params=0))
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    pos = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 0], list(range(9))])
    x = _rand(7, 2, 9, 32)
    cos, sin = rope_cos_sin(jnp.asarray(pos), 8, cfg.rope_theta)
    out = np.asarray(attn(jnp.asarray(x), cos, sin, jnp.asarray(seg)))
    w = [attn.w_q[...], attn.w_k[...], attn.w_v[...], attn.w_o[...]]
    scales = (attn.q_norm.scale[...], attn.k_norm.scale[...])
    for row, start, stop in [(0, 0, 3), (0, 3, 7), (1, 0, 9)]:
        ref = np_ref.attention(
            x[row : row + 1, start:stop],
            *w,
            *scales,
            cfg.rms_norm_eps,
            cfg.rope_theta,
            pos[row : row + 1, start:stop],
        )
        err = np.abs(out[row : row + 1, start:stop] - ref).max()
        assert err <= 1e-6 * np.abs(ref).max(), (row, start, err)
    assert np.isfinite(out).all()


def test_blocked_attention_equals_one_piece_forward_and_backward(monkeypatch):
    # 32 queries in blocks of 8 against the one-piece computation: the same rows, each with its
    # whole key row and softmax, so outputs and gradients agree to float32 rounding (measured:
    # loss 1.2e-7 relative, gradients <= 3.7e-7 of the largest entry; bound 1e-6). Two packed
    # documents and padding.
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 32, h, 8)), jnp.float32) for h in (4, 2, 2))
    seg = jnp.asarray(np.array([[1] * 13 + [2] * 15 + [0] * 4, [1] * 32]))

    def run(block):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)

        def loss(q, k, v):
            return jnp.sum(attention.attend(q, k, v, seg) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    (ref, ref_g), (got, got_g) = run(1024), run(8)
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref))
    for a, b in zip(got_g, ref_g, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-6 * float(jnp.max(jnp.abs(b)))


def test_attention_rejects_bad_gqa_grouping():
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        Attention(ModelConfig(num_heads=4, num_kv_heads=3), rngs=nnx.Rngs(params=0))


def test_swiglu_matches_reference_on_any_leading_axes():
    mlp = SwiGLU(
        16, 24, init_std=0.3, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(params=0)
    )
    x = _rand(4, 2, 3, 16)
    ref = np_ref.swiglu(x, mlp.w_gate[...], mlp.w_up[...], mlp.w_down[...])
    np.testing.assert_allclose(mlp(jnp.asarray(x)), ref, **TOL)
    np.testing.assert_allclose(mlp(jnp.asarray(x[0])), ref[0], **TOL)


def test_params_carry_logical_axes():
    cfg = ModelConfig(emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8)  # shapes as above
    attn = Attention(cfg, qk_norm=True, rngs=nnx.Rngs(params=0))
    specs = nnx.get_partition_spec(nnx.state(attn))
    assert tuple(specs["w_q"].get_value()) == ("embed", "heads", "head_dim")
    assert tuple(specs["w_k"].get_value()) == ("embed", "kv_heads", "head_dim")
    assert tuple(specs["w_o"].get_value()) == ("heads", "head_dim", "embed")
    assert tuple(specs["q_norm"]["scale"].get_value()) == ("norm",)
