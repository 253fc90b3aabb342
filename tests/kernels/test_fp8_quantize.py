"""FP8 block quantization against the float64 NumPy oracle (moetext.kernels.quant.fp8_reference).

Legend: R rows, C columns, bs block size. Runtime: a few seconds (no Pallas here).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moetext.kernels.quant import (
    DualQuantized,
    Quantized,
    dequantize,
    dequantize_tiles,
    dual_quantize,
    quantize,
    quantize_tiles,
)
from moetext.kernels.quant import fp8_reference as ref

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _x(shape, seed=0, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize(
    "shape,axis,bs,dtype",
    [
        ((64, 256), -1, 128, E4M3),
        ((256, 48), 0, 128, E4M3),
        ((3, 200, 40), 1, 128, E4M3),  # ragged tail: 200 = 128 + 72
        ((5, 96), 1, 32, E5M2),
        ((4, 70), -1, 16, E5M2),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_quantize_matches_reference(shape, axis, bs, dtype, jit):
    x = _x(shape, scale=3.0)
    fn = lambda x: quantize(x, axis=axis, block_size=bs, dtype=dtype)
    q, s = (jax.jit(fn) if jit else fn)(x)
    q_ref, s_ref = ref.quantize_reference(x, axis=axis, block_size=bs, dtype=dtype)
    assert q.shape == x.shape and q.dtype == dtype
    nb = -(-shape[axis] // bs)
    assert s.shape == shape[: axis % len(shape)] + (nb,) + shape[axis % len(shape) + 1 :]
    # Exact: both sides compute the same float32 scale, the same float32 product x * (1/scale),
    # and one round-to-nearest-even into FP8.
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    dq = dequantize(q, s, axis=axis, block_size=bs, dtype=jnp.float32)
    # float32 product of a 4-bit FP8 significand and a float32 scale: one float32 rounding.
    np.testing.assert_allclose(
        np.asarray(dq),
        ref.dequantize_reference(q_ref, s_ref, axis=axis, block_size=bs),
        rtol=2**-23,
        atol=0,
    )


def test_bf16_input_and_output_dtype():
    x = _x((8, 256), dtype=jnp.bfloat16)
    q, s = quantize(x)
    q_ref, s_ref = ref.quantize_reference(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    assert s.dtype == jnp.float32
    assert dequantize(q, s).dtype == jnp.bfloat16


def test_round_trip_error_bound_over_wide_range():
    # Per element: e4m3 keeps 3 mantissa bits, so a normal FP8 value is within 2^-4 relative;
    # below FP8's smallest normal (2^-6 * scale) the grid is the subnormal step 2^-9 * scale.
    x = _x((16, 512), seed=1) * jnp.exp(_x((16, 512), seed=2, scale=4.0))
    q, s = quantize(x)
    dq = np.asarray(dequantize(q, s, dtype=jnp.float32), np.float64)
    xs = np.asarray(x, np.float64)
    s_el = np.repeat(np.asarray(s, np.float64), 128, axis=1)
    bound = np.maximum(2.0**-4 * np.abs(xs), 2.0**-10 * s_el) * (1 + 1e-6)
    assert np.all(np.abs(dq - xs) <= bound)


def test_zero_blocks_are_safe():
    x = jnp.zeros((4, 256)).at[1, 130].set(5.0)
    q, s = quantize(x)
    assert np.all(np.isfinite(np.asarray(s)))
    # All-zero blocks get scale 1 (documented), so they dequantize to exact zeros.
    assert np.asarray(s)[0, 0] == 1.0 and np.asarray(s)[1, 0] == 1.0
    np.testing.assert_array_equal(np.asarray(dequantize(q, s, dtype=jnp.float32)), np.asarray(x))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1e20, 3e38])
def test_tiny_and_huge_magnitudes(magnitude):
    x = _x((4, 256), seed=3) * magnitude
    x = jnp.clip(x, -3.4e38, 3.4e38)  # stays finite in float32
    q, s = quantize(x)
    q_ref, s_ref = ref.quantize_reference(x)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    dq = np.asarray(dequantize(q, s, dtype=jnp.float32), np.float64)
    xs = np.asarray(x, np.float64)
    assert np.all(np.isfinite(dq))
    # Same per-element bound as the round trip test, relative to the block scale.
    bound = np.maximum(2.0**-4 * np.abs(xs), 2.0**-10 * np.repeat(s_ref, 128, 1)) * 1.0001
    assert np.all(np.abs(dq - xs) <= bound)


def test_subnormal_inputs_stay_finite():
    # float32 subnormals: XLA flushes them to zero (documented), so the block counts as all
    # zero (scale 1, q 0); amax / 448 never reaches a division. Either way nothing is NaN/inf
    # and the round trip error is at most |x|.
    x = jnp.full((1, 128), 1e-42, jnp.float32).at[0, 5].set(-3e-41)
    q, s = quantize(x)
    dq = np.asarray(dequantize(q, s, dtype=jnp.float32), np.float64)
    assert np.all(np.isfinite(np.asarray(s))) and np.all(np.isfinite(dq))
    assert np.all(np.abs(dq - np.asarray(x, np.float64)) <= np.abs(np.asarray(x, np.float64)))
    # Smallest normal amax: the scale floor (float32 tiny) keeps x * (1 / scale) finite.
    x = jnp.full((1, 128), 2e-38, jnp.float32)
    q, s = quantize(x)
    assert float(s[0, 0]) == np.finfo(np.float32).tiny
    assert np.all(np.isfinite(np.asarray(q, np.float32)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_poisons_only_its_block(bad):
    x = _x((2, 384), seed=4).at[0, 140].set(bad)
    q, s = quantize(x)
    dq = np.asarray(dequantize(q, s, dtype=jnp.float32))
    # Documented: a non-finite value makes its whole block dequantize to NaN; other blocks
    # (other row, other column blocks) are untouched.
    assert np.all(np.isnan(dq[0, 128:256]))
    q_ref, s_ref = ref.quantize_reference(x)
    clean = np.ones_like(dq, bool)
    clean[0, 128:256] = False
    np.testing.assert_array_equal(
        dq[clean], ref.dequantize_reference(q_ref, s_ref)[clean].astype(np.float32)
    )


def test_checked_raises_on_non_finite():
    x = _x((2, 128)).at[1, 3].set(jnp.inf)
    with pytest.raises(Exception, match="inf or NaN"):
        jax.block_until_ready(quantize(x, checked=True))
    jax.block_until_ready(quantize(_x((2, 128)), checked=True))  # finite input passes


def test_user_errors_name_the_problem():
    x = _x((4, 256))
    with pytest.raises(ValueError, match="axis 2 out of range"):
        quantize(x, axis=2)
    with pytest.raises(ValueError, match="block_size"):
        quantize(x, block_size=0)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        quantize(x, dtype=jnp.bfloat16)
    q, s = quantize(x)
    with pytest.raises(ValueError, match=r"expected \(4, 4\)"):
        dequantize(q, s, block_size=64)


def test_dual_quantize_orientations_come_from_the_source():
    x = _x((256, 384), seed=5)
    d = dual_quantize(x)
    assert isinstance(d, DualQuantized)
    row_q, row_s = quantize(x, axis=-1)
    col_q, col_s = quantize(x, axis=-2)
    np.testing.assert_array_equal(np.asarray(d.rowwise.value, np.float32), row_q.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(d.rowwise.scale), np.asarray(row_s))
    np.testing.assert_array_equal(np.asarray(d.colwise.value, np.float32), col_q.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(d.colwise.scale), np.asarray(col_s))
    # Re-quantizing the rowwise copy would round twice; the colwise copy must not match that.
    twice_q, _ = quantize(d.rowwise.dequantize(jnp.float32), axis=-2)
    assert np.any(np.asarray(twice_q, np.float32) != np.asarray(col_q, np.float32))
    assert (d.rowwise.axis, d.colwise.axis) == (1, 0)


def test_quantized_is_a_jit_friendly_pytree():
    d = jax.jit(lambda x: dual_quantize(x, block_size=64))(_x((64, 128)))
    leaves = jax.tree_util.tree_leaves(d)
    assert len(leaves) == 4  # values and scales; axis and block_size are static
    assert d.rowwise.block_size == 64
    out = jax.jit(lambda q: q.dequantize(jnp.float32))(d.colwise)
    assert out.shape == (64, 128)


def test_quantize_tiles_matches_reference():
    w = _x((2, 200, 300), seed=6)  # ragged tiles on both axes
    q, s = quantize_tiles(w)
    q_ref, s_ref = ref.quantize_tiles_reference(w)
    assert s.shape == (2, 2, 3)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    np.testing.assert_allclose(
        np.asarray(dequantize_tiles(q, s, dtype=jnp.float32)),
        ref.dequantize_tiles_reference(q_ref, s_ref),
        rtol=2**-23,
        atol=0,
    )
    t = Quantized.of(w, axis=None)
    assert t.axis is None and t.nbytes == w.size + s.size * 4


def test_quantization_error_on_normal_data():
    # Reported in docs/kernels.md: e4m3 1x128 blocks on N(0, 1) give ~2.5% relative Frobenius
    # error per tensor (uniform relative rounding of 3 mantissa bits). Bound with margin.
    x = _x((512, 512), seed=7)
    dq = np.asarray(dequantize(*quantize(x), dtype=jnp.float32), np.float64)
    xs = np.asarray(x, np.float64)
    err = np.linalg.norm(dq - xs) / np.linalg.norm(xs)
    assert 0.01 < err < 0.04, err
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == 448


@pytest.mark.parametrize(
    "shape,bs,dtype", [((300, 256), 128, E4M3), ((3, 40, 384), 128, E5M2), ((8, 96), 32, E4M3)]
)
def test_pallas_quantize_kernel_matches_reference(shape, bs, dtype):
    # The Pallas kernel for last-axis blocks (used with the pallas_tpu backend; interpret mode
    # here) must be bit-exact with the oracle too, including zero and non-finite blocks.
    x = _x(shape, seed=8, dtype=jnp.bfloat16) * jnp.exp(_x(shape, seed=9, dtype=jnp.bfloat16))
    x = x.at[(0,) * (len(shape) - 1) + (slice(0, bs),)].set(0)
    x = x.at[(1,) * (len(shape) - 1) + (bs + 1,)].set(jnp.nan)
    q, s = quantize(x, block_size=bs, dtype=dtype, impl="pallas")
    q_ref, s_ref = ref.quantize_reference(np.asarray(x, np.float32), block_size=bs, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(s), s_ref)  # NaN == NaN for array_equal
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    with pytest.raises(ValueError, match="impl must be"):
        quantize(x, impl="mosaic")
