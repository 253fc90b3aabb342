"""The fp8_blockwise recipe over every registered gmm backend: forward and gradients against
FP8 oracles.

Legend: M rows, K contraction, N outputs, G groups, L local groups (window from group_offset).
Oracles: quantize with reference.quantize_reference (bit-exact with the implementation, see
test_fp8_quantize), multiply dequantized operands in float64. Runtime: ~50 s on 2 cores.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moetext.kernels.gmm import Gmm, GmmCall, available_backends, get_backend
from moetext.kernels.quant import Fp8Blockwise
from moetext.kernels.quant import fp8_reference as ref

# Emulated backends multiply float32-dequantized operands (one float32 rounding each) and the
# FP8 kernels multiply exactly; both accumulate in float32: ~K * 2^-24 of the largest output.
TOL = 1e-5
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
M, K, N, G, L, OFFSET = 256, 256, 128, 4, 3, 1
SIZES = [40, 70, 0, 100]  # window = groups 1..3; rows 0..39 and 210..255 are outside it


def _close(out, want):
    out = np.asarray(out, np.float64)
    np.testing.assert_allclose(out, want, rtol=0, atol=TOL * np.abs(want).max())


def _data(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _q(x, axis, dtype=E4M3, bs=128):
    return ref.quantize_reference(np.asarray(x, np.float32), axis=axis, block_size=bs, dtype=dtype)


def _call(op, lhs, rhs, transpose=False, pet=jnp.float32):
    """The recipe's differentiable gmm, called as the Gmm op calls it."""
    return op.recipe.gmm(
        op.backend,
        lhs,
        rhs,
        jnp.asarray(SIZES, jnp.int32),
        GmmCall(pet, jnp.int32(OFFSET), None, transpose_rhs=transpose),
    )


def test_recipe_validation():
    with pytest.raises(ValueError, match="valid: 1x128, 128x128"):
        Fp8Blockwise(weight_block="128x1")
    with pytest.raises(ValueError, match="valid: 1x32, 32x32"):
        Fp8Blockwise(block_size=32, weight_block="1x128")
    with pytest.raises(ValueError, match="bwd_quantize"):
        Fp8Blockwise(bwd_quantize="yes")
    with pytest.raises(ValueError, match="grad_dtype"):
        Fp8Blockwise(grad_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="save_rhs"):
        Fp8Blockwise(save_rhs="bf16")
    assert Fp8Blockwise(grad_dtype=jnp.float8_e5m2).grad_dtype == "float8_e5m2"
    assert hash(Fp8Blockwise()) == hash(Fp8Blockwise())  # static argument of the custom_vjp


def test_recipe_wraps_any_backend():
    op = Gmm(get_backend("ragged_dot"), Fp8Blockwise())
    assert op.name == "fp8_blockwise[ragged_dot]"
    # bwd_quantize="auto": on where the backend has fused scaled kernels (pallas_tpu).
    assert not Fp8Blockwise().bind(get_backend("ragged_dot")).bwd_quantize
    assert Fp8Blockwise().bind(get_backend("pallas_tpu")).bwd_quantize
    with pytest.raises(ValueError, match="backend must be a GmmBackend"):
        Gmm(op)  # a quantized op is not a backend: recipes do not stack
    with pytest.raises(ValueError, match="backend must be a GmmBackend"):
        Gmm(object())
    with pytest.raises(ValueError, match="recipe must be a Recipe"):
        Gmm(get_backend("ragged_dot"), "fp8_blockwise")


@pytest.mark.parametrize("name", available_backends())
def test_every_backend_gives_fp8_numbers(name):
    # blocked is the slowest here (~10 s of XLA:CPU compiles for its loops) but stays: it is the
    # CPU default. Forward gmm (EP window, transposed weights) and tgmm through the protocol.
    be, recipe = get_backend(name), Fp8Blockwise()
    x, w, d = _data((M, K), 0), _data((L, N, K), 1), _data((M, N), 2)
    gs = jnp.asarray(SIZES, jnp.int32)
    out = recipe.gmm(be, x, w, gs, GmmCall(jnp.float32, jnp.int32(OFFSET), transpose_rhs=True))
    want = ref.gmm_fp8_reference(
        *_q(x, 1), *_q(w, 2), SIZES, group_offset=OFFSET, transpose_rhs=True
    )
    _close(out, want)
    out_t = recipe.tgmm(be, x, d, gs, GmmCall(jnp.float32, jnp.int32(OFFSET), num_groups=L))
    _close(
        out_t,
        ref.tgmm_fp8_reference(*_q(x, 0), *_q(d, 0), SIZES, num_groups=L, group_offset=OFFSET),
    )


def _grad_oracle(x, w, dy, transpose, grad_dtype=E4M3):
    """FP8 oracles for (out, dlhs, drhs) with a quantized backward (bwd_quantize=True)."""
    contract, other = (2, 1) if transpose else (1, 2)
    out = ref.gmm_fp8_reference(
        *_q(x, 1), *_q(w, contract), SIZES, group_offset=OFFSET, transpose_rhs=transpose
    )
    dlhs = ref.gmm_fp8_reference(
        *_q(dy, 1, grad_dtype),
        *_q(w, other),
        SIZES,
        group_offset=OFFSET,
        transpose_rhs=not transpose,
    )
    a, b = _q(x, 0), _q(dy, 0, grad_dtype)
    args = (*b, *a) if transpose else (*a, *b)
    drhs = ref.tgmm_fp8_reference(*args, SIZES, num_groups=L, group_offset=OFFSET)
    return out, dlhs, drhs


# ragged_dot stands for the emulated backends (blocked and reference take the same emulation
# path and only add compile / callback time); pallas_tpu runs the FP8 kernels.
@pytest.mark.parametrize("name", ["pallas_tpu", "ragged_dot"])
@pytest.mark.parametrize("transpose", [False, True])
def test_gradients_match_quantized_reference(name, transpose):
    qb = Gmm(get_backend(name), Fp8Blockwise(bwd_quantize=True))
    x, dy = _data((M, K), 3), _data((M, N), 4)
    w = _data((L, N, K) if transpose else (L, K, N), 5)
    out, vjp = jax.vjp(lambda x, w: _call(qb, x, w, transpose), x, w)
    dx, dw = vjp(dy)
    want = _grad_oracle(x, w, dy, transpose)
    for got, exp in zip((out, dx, dw), want, strict=True):
        _close(got, exp)


def test_e5m2_gradients_and_fp8_weight_residuals():
    recipe = Fp8Blockwise(bwd_quantize=True, grad_dtype="float8_e5m2", save_rhs="fp8")
    qb = Gmm(get_backend("ragged_dot"), recipe)
    x, w, dy = _data((M, K), 6), _data((L, K, N), 7), _data((M, N), 8)
    out, vjp = jax.vjp(lambda x, w: _call(qb, x, w), x, w)
    for got, exp in zip((out, *vjp(dy)), _grad_oracle(x, w, dy, False, E5M2), strict=True):
        _close(got, exp)
    # Residuals: FP8 values (+ float32 scales and the int32 group sizes) only.
    kinds = {jnp.dtype(r.dtype).name for r in jax.tree_util.tree_leaves(vjp)}
    assert kinds == {"float8_e4m3fn", "float32", "int32"}, kinds


def test_unquantized_backward_uses_fp8_residuals():
    # bwd_quantize=False: dlhs = dout @ w.T at input precision; drhs from the dequantized
    # rowwise FP8 lhs (the forward's own quantization, saved instead of a copy of x).
    qb = Gmm(get_backend("ragged_dot"), Fp8Blockwise(bwd_quantize=False))
    x, w, dy = _data((M, K), 9), _data((L, K, N), 10), _data((M, N), 11)
    _, vjp = jax.vjp(lambda x, w: _call(qb, x, w), x, w)
    dx, dw = vjp(dy)
    _close(dx, ref.gmm_reference_f64(dy, w, SIZES, group_offset=OFFSET, transpose_rhs=True))
    x_dq = ref.dequantize_reference(*_q(x, 1), axis=1)
    _close(dw, ref.tgmm_reference_f64(x_dq, dy, SIZES, num_groups=L, group_offset=OFFSET))


@pytest.mark.parametrize("name", ["pallas_tpu", "ragged_dot"])
def test_square_weight_tiles(name):
    # 128x128 weight tiles: one quantization of w serves the forward (contract K) and the
    # backward (contract N); K = 256 and N = 256 give a 2 x 2 grid of tile scales.
    qb = Gmm(get_backend(name), Fp8Blockwise(weight_block="128x128", bwd_quantize=True))
    x, w, dy = _data((M, K), 12), _data((L, K, 256), 13), _data((M, 256), 14)
    out, vjp = jax.vjp(lambda x, w: _call(qb, x, w), x, w)
    dx, dw = vjp(dy)
    wq, ws = ref.quantize_tiles_reference(w)
    per_col = np.repeat(ws, 128, axis=2)  # [L, K/128, N]: a tile scale for each column
    per_row = np.repeat(ws, 128, axis=1)  # [L, K, N/128]: for contracting N
    _close(out, ref.gmm_fp8_reference(*_q(x, 1), wq, per_col, SIZES, group_offset=OFFSET))
    _close(
        dx,
        ref.gmm_fp8_reference(
            *_q(dy, 1), wq, per_row, SIZES, group_offset=OFFSET, transpose_rhs=True
        ),
    )
    _close(
        dw, ref.tgmm_fp8_reference(*_q(x, 0), *_q(dy, 0), SIZES, num_groups=L, group_offset=OFFSET)
    )


def test_residuals_hold_no_high_precision_activation():
    qb = Gmm(get_backend("ragged_dot"), Fp8Blockwise())
    x, w = _data((M, K), 15, jnp.bfloat16), _data((L, K, N), 16, jnp.bfloat16)
    out, vjp = jax.vjp(lambda x, w: _call(qb, x, w, pet=jnp.bfloat16), x, w)
    res = [(r.shape, jnp.dtype(r.dtype).name) for r in jax.tree_util.tree_leaves(vjp)]
    assert ((M, K), "float8_e4m3fn") in res and ((M, K), "bfloat16") not in res, res
    # save_rhs="input": the weights are kept as given (a parameter: no extra memory).
    assert ((L, K, N), "bfloat16") in res
    dx, dw = vjp(jnp.ones_like(out))
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)


def test_tgmm_gradient_runs_on_dequantized_residuals():
    qb = Gmm(get_backend("ragged_dot"), Fp8Blockwise())
    x, d, dout = _data((M, K), 17), _data((M, N), 18), _data((L, K, N), 19)
    f = lambda x, d: qb.recipe.tgmm(
        qb.backend,
        x,
        d,
        jnp.asarray(SIZES, jnp.int32),
        GmmCall(jnp.float32, jnp.int32(OFFSET), num_groups=L),
    )
    out, vjp = jax.vjp(f, x, d)
    dx, dd = vjp(dout)
    xq, dq = (
        ref.dequantize_reference(*_q(x, 0), axis=0),
        ref.dequantize_reference(*_q(d, 0), axis=0),
    )
    _close(out, ref.tgmm_reference_f64(xq, dq, SIZES, num_groups=L, group_offset=OFFSET))
    # out[g] = x_g.T d_g  =>  dx_g = d_g dout[g].T, dd_g = x_g dout[g] (others zero).
    _close(dx, ref.gmm_reference_f64(dq, dout, SIZES, group_offset=OFFSET, transpose_rhs=True))
    _close(dd, ref.gmm_reference_f64(xq, dout, SIZES, group_offset=OFFSET))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1"])
def test_fp8_training_gradient_compiles_for_tpu(topology):
    from jax.sharding import SingleDeviceSharding

    from moetext.aot import tpu_devices
    from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend

    dev = tpu_devices(topology)[0]
    qb = Gmm(PallasTpuBackend.for_device(dev), Fp8Blockwise())
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(dev))
    m, k, n, g = 1024, 512, 256, 4

    def loss(x, w, gs):
        out = qb(x, w, gs, preferred_element_type=jnp.bfloat16)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = grad.lower(
        sds((m, k), jnp.bfloat16), sds((g, k, n), jnp.bfloat16), sds((g,), jnp.int32)
    ).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3  # fwd gmm_fp8, bwd gmm_fp8 and tgmm_fp8
    assert "f8e4m3fn" in text


def test_gmm_op_routes_through_the_fp8_autodiff():
    # Gmm.__call__ / Gmm.tgmm hand the math to the recipe, which owns the autodiff, so the public
    # op keeps FP8 residuals and the FP8 backward.
    qb = Gmm(get_backend("ragged_dot"), Fp8Blockwise(bwd_quantize=True))
    x, w, dy = _data((M, K), 20), _data((L, K, N), 21), _data((M, N), 22)
    gs = jnp.asarray(SIZES, jnp.int32)
    f = lambda x, w: qb(x, w, gs, group_offset=OFFSET, preferred_element_type=jnp.float32)
    out, vjp = jax.vjp(f, x, w)
    for got, exp in zip((out, *vjp(dy)), _grad_oracle(x, w, dy, False), strict=True):
        _close(got, exp)
    assert "float8_e4m3fn" in {jnp.dtype(r.dtype).name for r in jax.tree_util.tree_leaves(vjp)}
    d = _data((M, N), 23)
    out_t, vjp_t = jax.vjp(lambda x: qb.tgmm(x, d, gs, num_groups=L, group_offset=OFFSET), x)
    _close(
        out_t,
        ref.tgmm_fp8_reference(*_q(x, 0), *_q(d, 0), SIZES, num_groups=L, group_offset=OFFSET),
    )
    assert {jnp.dtype(r.dtype).name for r in jax.tree_util.tree_leaves(vjp_t)} >= {"float8_e4m3fn"}
