"""Pallas gmm_fp8 / tgmm_fp8 (interpret mode here) against the float64 FP8 oracles.

Legend: M rows, K contraction, N outputs, G groups, L local groups, bs block size, tm/tk/tn
tiles. Shapes are small (interpret mode is slow) but K and M are multiples of 128 where the
block structure matters. Runtime: ~40 s on 2 CPU cores; the tpu_aot tests add ~20 s.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetext.kernels.pallas import gmm_fp8, tgmm_fp8
from moetext.kernels.quant import fp8_reference as ref
from moetext.kernels.quant import quantize

# Each FP8 x FP8 product is exact in float32 and each bs-long partial sum is scaled once, so the
# kernels differ from the float64 oracle only by float32 accumulation: ~K * 2^-24 relative to
# the largest output. 1e-5 of max|ref| leaves ~10x margin at K <= 512 and still catches a single
# misplaced scale block (a factor >= 2 error on a 1/16 share of the output).
TOL = 1e-5


def _close(out, want):
    out = np.asarray(out, np.float64)
    np.testing.assert_allclose(out, want, rtol=0, atol=TOL * np.abs(want).max())


def _data(shape, seed, block_rows=None):
    x = np.random.default_rng(seed).standard_normal(shape)
    if block_rows:  # magnitudes that differ by 4^b across 128-row blocks: scales must not mix
        x *= (4.0 ** (np.arange(shape[0]) // block_rows))[:, None]
    return jnp.asarray(x, jnp.float32)


GMM_CASES = [
    # M, K, N, group_sizes, num_local, offset, transpose, tiling, bs
    (256, 256, 256, [100, 0, 150], 3, None, False, (128, 256, 128), 128),  # 2 sub-blocks per tk
    (192, 384, 128, [50, 90, 40, 12], 4, None, True, (64, 128, 128), 128),  # rows past sum
    (256, 512, 128, [30, 70, 100, 56], 2, 1, False, (128, 512, 128), 128),  # EP window
    (128, 128, 128, [64, 64], 2, None, True, (128, 128, 128), 64),  # bs 64: 2 sub-blocks
]


@pytest.mark.parametrize("m,k,n,sizes,num_local,offset,transpose,tiling,bs", GMM_CASES)
def test_gmm_fp8_matches_reference(m, k, n, sizes, num_local, offset, transpose, tiling, bs):
    lhs_q, lhs_s = quantize(_data((m, k), 0), axis=1, block_size=bs)
    rhs_shape = (num_local, n, k) if transpose else (num_local, k, n)
    rhs_q, rhs_s = quantize(_data(rhs_shape, 1), axis=2 if transpose else 1, block_size=bs)
    gs = jnp.asarray(sizes, jnp.int32)
    out = gmm_fp8(
        lhs_q,
        lhs_s,
        rhs_q,
        rhs_s,
        gs,
        group_offset=offset or 0,
        transpose_rhs=transpose,
        block_size=bs,
        tiling=tiling,
        preferred_element_type=jnp.float32,
    )
    want = ref.gmm_fp8_reference(
        lhs_q,
        lhs_s,
        rhs_q,
        rhs_s,
        gs,
        group_offset=offset or 0,
        transpose_rhs=transpose,
        block_size=bs,
    )
    _close(out, want)


@pytest.mark.parametrize("tm", [128, 256, 512])
@pytest.mark.parametrize("tk", [128, 256])
def test_tgmm_fp8_subchannel_over_tm(tm, tk):
    # Group boundaries at rows 37, 237, 387, 447 all fall inside 128-row scale blocks, and rows
    # 447..511 belong to no group. Per-block magnitudes differ by 4x, so applying one scale per
    # tm tile (instead of one per 128-row block) would be off by far more than TOL.
    m, k, n = 512, 256, 128
    gs = jnp.asarray([37, 0, 200, 150, 60], jnp.int32)
    a_q, a_s = quantize(_data((m, k), 2, block_rows=128), axis=0)
    b_q, b_s = quantize(_data((m, n), 3), axis=0)
    out = tgmm_fp8(a_q, a_s, b_q, b_s, gs, num_groups=5, tiling=(tm, tk, 128))
    _close(out, ref.tgmm_fp8_reference(a_q, a_s, b_q, b_s, gs, num_groups=5))
    assert not np.any(np.asarray(out)[1])  # the empty group


def test_tgmm_fp8_ragged_m_and_window():
    # M = 300 is not a multiple of the 128-row block or of tm; two local groups of four.
    m, k, n = 300, 128, 256
    gs = jnp.asarray([90, 70, 100, 40], jnp.int32)
    a_q, a_s = quantize(_data((m, k), 4, block_rows=128), axis=0)
    b_q, b_s = quantize(_data((m, n), 5), axis=0)
    out = tgmm_fp8(a_q, a_s, b_q, b_s, gs, num_groups=2, group_offset=1, tiling=(256, 128, 128))
    want = ref.tgmm_fp8_reference(a_q, a_s, b_q, b_s, gs, num_groups=2, group_offset=1)
    _close(out, want)


def _err(out, exact):
    out = np.asarray(out, np.float64).ravel()
    exact = exact.ravel()
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    return rel, out @ exact / (np.linalg.norm(out) * np.linalg.norm(exact))


def test_fp8_error_vs_bf16_on_normal_data():
    # Measured (docs/kernels.md): block-wise e4m3 gives ~3.6% relative Frobenius error and
    # cosine ~0.9993 against the exact product; bf16 inputs give ~0.4%. Bounds: < 6%, > 0.998.
    m, k, n = 256, 256, 256
    gs = jnp.asarray([128, 128], jnp.int32)
    x, w, d = _data((m, k), 6), _data((2, k, n), 7), _data((m, n), 8)
    exact = ref.gmm_reference_f64(x, w, gs)
    out = gmm_fp8(
        *quantize(x, axis=1),
        *quantize(w, axis=1),
        gs,
        tiling=(128, 256, 128),
        preferred_element_type=jnp.float32,
    )
    rel, cos = _err(out, exact)
    assert rel < 0.06 and cos > 0.998, (rel, cos)
    bf16 = jax.lax.ragged_dot(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), gs, preferred_element_type=jnp.float32
    )
    assert _err(bf16, exact)[0] < 0.01  # the baseline the FP8 error is compared against
    exact_t = ref.tgmm_reference_f64(x, d, gs, num_groups=2)
    out_t = tgmm_fp8(
        *quantize(x, axis=0), *quantize(d, axis=0), gs, num_groups=2, tiling=(256, 256, 256)
    )
    rel, cos = _err(out_t, exact_t)
    assert rel < 0.06 and cos > 0.998, (rel, cos)


def test_user_errors():
    q, s = quantize(_data((64, 200), 9), axis=1)
    wq, ws = quantize(_data((1, 200, 128), 10), axis=1)
    gs = jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match="K % block_size == 0"):
        gmm_fp8(q, s, wq, ws, gs)
    q, s = quantize(_data((64, 256), 9), axis=1)
    wq, ws = quantize(_data((1, 256, 128), 10), axis=1)
    with pytest.raises(ValueError, match="tk=192 must be a multiple of block_size=128"):
        gmm_fp8(q, s, wq, ws, gs, tiling=(64, 192, 128))
    aq, as_ = quantize(_data((256, 128), 11), axis=0)
    with pytest.raises(ValueError, match="tm=192 must be a multiple of block_size=128"):
        tgmm_fp8(aq, as_, aq, as_, gs, num_groups=1, tiling=(192, 128, 128))
    with pytest.raises(ValueError, match="scale"):
        tgmm_fp8(aq, as_[:1], aq, as_, gs, num_groups=1)


TOPOLOGIES = ["v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fp8_kernels_compile_for_tpu(topology):
    from jax.sharding import SingleDeviceSharding

    from moetext.aot import tpu_devices
    from moetext.kernels.pallas import tiling as tiling_lib

    dev = tpu_devices(topology)[0]
    chip = tiling_lib.chip_from_device_kind(dev.device_kind)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(dev))
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    m, k, n, g = 1024, 512, 512, 4
    kw = dict(interpret=False, chip=chip, tiling=(256, 256, 256))
    gmm_c = (
        jax.jit(lambda *a: gmm_fp8(*a, **kw))
        .lower(
            sds((m, k), f8),
            sds((m, k // 128), f32),
            sds((g, k, n), f8),
            sds((g, k // 128, n), f32),
            sds((g,), jnp.int32),
        )
        .compile()
    )
    tgmm_c = (
        jax.jit(lambda *a: tgmm_fp8(*a, num_groups=g, **kw))
        .lower(
            sds((m, k), f8),
            sds((m // 128, k), f32),
            sds((m, n), f8),
            sds((m // 128, n), f32),
            sds((g,), jnp.int32),
        )
        .compile()
    )
    for c in (gmm_c, tgmm_c):
        text = c.as_text()
        assert "tpu_custom_call" in text and "f8e4m3fn" in text  # FP8 operands reach Mosaic
    # The last-axis quantize kernel: no float32 copy of x (XLA's lowering needs 4 * m * k bytes);
    # what remains is the lane-padded [m, k / 128] scale output (m * 512 bytes).
    q_c = (
        jax.jit(lambda x: quantize(x, impl="pallas", interpret=False))
        .lower(sds((m, k), jnp.bfloat16))
        .compile()
    )
    assert "tpu_custom_call" in q_c.as_text()
    assert q_c.memory_analysis().temp_size_in_bytes < 2 * m * k  # under the bf16 input size
