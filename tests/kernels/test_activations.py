"""kernels/activations.swiglu: the forward is JAX's silu(g) * u, the backward (which keeps only
g and u) matches a float64 NumPy oracle, and under fp8_blockwise g and u are kept as FP8; with
a per-row scale (the MoE routing weights) the same against the oracle, scale's gradient too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetext.kernels.activations import swiglu
from moetext.kernels.gmm import Gmm, get_backend
from moetext.kernels.quant import Fp8Blockwise, quantize


def _data(dtype, seed=0, shape=(64, 256)):
    rng = np.random.default_rng(seed)
    g, u, dh = (rng.standard_normal(shape) * s for s in (3.0, 1.0, 1.0))
    return [jnp.asarray(a, dtype) for a in (g, u, dh)]


def _oracle(g, u, dh):
    g, u, dh = (np.asarray(a, np.float64) for a in (g, u, dh))
    s = 1 / (1 + np.exp(-g))
    return dh * u * (s + g * s * (1 - s)), dh * g * s


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_silu_times_up_and_grads_match_float64(dtype):
    g, u, dh = _data(dtype)
    out, vjp = jax.vjp(swiglu, g, u)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.nn.silu(g) * u))
    dg, du = vjp(dh)
    assert dg.dtype == du.dtype == dtype
    want_g, want_u = _oracle(g, u, dh)
    # float32 math in the backward, rounded once to the output dtype: half an ulp of it
    # (f32: 2^-24, bf16: 2^-9) times max|grad|, plus f32 rounding of the intermediate products.
    tol = 4e-6 if dtype == jnp.float32 else 2**-8
    for got, want in ((dg, want_g), (du, want_u)):
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < tol, err


def test_backward_keeps_only_g_and_u():
    g, u, _ = _data(jnp.bfloat16)
    _, vjp = jax.vjp(swiglu, g, u)
    kept = [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(vjp)]
    assert sorted(kept, key=str) == [(g.shape, jnp.bfloat16)] * 2, kept


def test_quantizing_recipe_keeps_fp8_and_grads_use_them():
    qb = Gmm(get_backend("ragged_dot"), Fp8Blockwise(block_size=128))
    g, u, dh = _data(jnp.bfloat16)
    out, vjp = jax.vjp(lambda g, u: swiglu(g, u, gmm=qb), g, u)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.nn.silu(g) * u))
    kept = {(x.shape, jnp.dtype(x.dtype).name) for x in jax.tree_util.tree_leaves(vjp)}
    assert kept == {(g.shape, "float8_e4m3fn"), ((64, 2), "float32")}, kept
    # The backward is the exact derivative at the FP8-rounded g and u (the oracle dequantizes
    # the same blocks), and within FP8 error of the derivative at the bf16 inputs.
    dq = [quantize(a, axis=-1, block_size=128) for a in (g, u)]
    gq, uq = (np.asarray(q.astype(jnp.float32), np.float64) * np.repeat(s, 128, -1) for q, s in dq)
    want_g, want_u = _oracle(gq, uq, dh)
    dg, du = vjp(dh)
    for got, want in ((dg, want_g), (du, want_u)):
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < 2**-8, err
    exact_g, _ = _oracle(g, u, dh)
    frob = np.linalg.norm(np.asarray(dg, np.float64) - exact_g) / np.linalg.norm(exact_g)
    assert frob < 0.06, frob  # e4m3 block rounding of g and u: a few percent


def test_shape_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"gate \(4, 8\) and up \(4, 6\)"):
        swiglu(jnp.ones((4, 8)), jnp.ones((4, 6)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scaled_rows_and_all_three_grads_match_float64(dtype):
    # silu(g) * u * scale[:, None] in float32, rounded once; grads dg, du (dtype) and dscale
    # (float32: a sum over F = 256 of float32 products) against the float64 oracle.
    g, u, dh = _data(dtype)
    scale = jnp.asarray(np.random.default_rng(1).random(64), jnp.float32)
    out, vjp = jax.vjp(lambda g, u, s: swiglu(g, u, scale=s), g, u, scale)
    g64, u64, s64, dh64 = (np.asarray(a, np.float64) for a in (g, u, scale, dh))
    silu = g64 / (1 + np.exp(-g64))
    want = silu * u64 * s64[:, None]
    assert out.dtype == dtype
    tol = 4e-6 if dtype == jnp.float32 else 2**-8  # as above: one rounding to dtype
    assert np.max(np.abs(np.asarray(out, np.float64) - want)) / np.max(np.abs(want)) < tol
    dg, du, ds = vjp(dh)
    assert dg.dtype == du.dtype == dtype and ds.dtype == jnp.float32
    want_g, want_u = _oracle(g, u, dh64 * s64[:, None])
    want_s = np.sum(dh64 * silu * u64, axis=1)
    for got, exp, t in ((dg, want_g, tol), (du, want_u, tol), (ds, want_s, 1e-5)):
        err = np.max(np.abs(np.asarray(got, np.float64) - exp)) / np.max(np.abs(exp))
        assert err < t, err
    # It keeps g, u and the scale, nothing of the product.
    kept = sorted((x.shape, jnp.dtype(x.dtype).name) for x in jax.tree_util.tree_leaves(vjp))
    assert kept == sorted([(g.shape, jnp.dtype(dtype).name)] * 2 + [((64,), "float32")]), kept


def test_scale_of_the_wrong_shape_is_a_value_error():
    with pytest.raises(ValueError, match=r"scale must be \[M\] = \[4\].*got scale \(3,\)"):
        swiglu(jnp.ones((4, 8)), jnp.ones((4, 8)), scale=jnp.ones((3,)))
