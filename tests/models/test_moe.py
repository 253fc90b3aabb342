"""MoE router, dispatch and block against float64 NumPy oracles.

float32 compute throughout; tolerances: routing weights and losses are a handful of f32 ops on
O(1) values, so rtol = atol = 1e-5; block outputs sum K expert MLPs of width 16 over D = 32,
also well inside 1e-5 relative to the O(1e-1..1) outputs (checked with atol = 1e-5).
"""

import dataclasses

import jax
import jax.numpy as jnp
import np_ref
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, tiny_moe

from moetext.config.schema import KernelsConfig
from moetext.models.layers import SwiGLU
from moetext.models.moe import (
    MoEBlock,
    gmm_from_config,
    load_balance_loss,
    route,
    router_z_loss,
)
from moetext.models.moe import dispatch as dsp

TOL = dict(rtol=1e-5, atol=1e-5)
T, D, E, K = 16, 32, 4, 2


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _block(moe_cfg, seed=0, kernels=KERNELS):
    return MoEBlock(
        moe_cfg,
        gmm_from_config(kernels),
        emb_dim=D,
        init_std=0.3,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs=nnx.Rngs(params=seed),
    )


# One compiled program per block structure instead of dozens of eager op compiles.
_apply = nnx.jit(lambda block, x: block(x))


def _ids(seed, t=T, e=E, k=K):
    # K distinct experts per token, like top-k produces.
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_reference(norm):
    logits = _rand(0, T, E) * 2
    w, ids, probs = route(jnp.asarray(logits), K, norm)
    w_ref, ids_ref, probs_ref = np_ref.route(logits, K, norm)
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, **TOL)
    np.testing.assert_allclose(probs, probs_ref, **TOL)
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32


def test_aux_losses_match_reference():
    logits = _rand(1, T, E) * 3
    _, ids, probs = route(jnp.asarray(logits), K, True)
    lb = load_balance_loss(probs, ids)
    np.testing.assert_allclose(lb, np_ref.load_balance(np.asarray(probs), np.asarray(ids)), **TOL)
    np.testing.assert_allclose(router_z_loss(jnp.asarray(logits)), np_ref.z_loss(logits), **TOL)


def test_load_balance_is_one_when_uniform():
    # Uniform probabilities and every expert chosen equally often: E * sum (1/E)(1/E) * E = 1.
    probs = jnp.full((8, E), 1.0 / E)
    ids = jnp.asarray(np.arange(16).reshape(8, 2) % E, jnp.int32)
    np.testing.assert_allclose(load_balance_loss(probs, ids), 1.0, rtol=1e-6)


def test_permute_unpermute_round_trip():
    x = _rand(2, T, D)
    ids = _ids(3)
    xs, sizes, order = dsp.permute(jnp.asarray(x), jnp.asarray(ids), E)
    np.testing.assert_array_equal(sizes, np.bincount(ids.ravel(), minlength=E))
    # Sorted rows are grouped by expert, and stable: token order within each group.
    flat = ids.ravel()
    np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(xs), x[np.argsort(flat, kind="stable") // K])
    back = dsp.unpermute(xs, order, K)
    np.testing.assert_array_equal(np.asarray(back), np.repeat(x[:, None], K, axis=1))


def test_unpermute_sum_and_its_backward_keep_nothing_of_ys():
    # y_TD = sum_k ys[sorted row of (t, k)] (rows scaled before, by swiglu's scale); the
    # backward is dys[i] = dout[token of row i], and it keeps only the order (and a zero-size
    # dtype marker), so a rematerialised forward need not recompute ys. float32 sums of K = 2.
    ys, ids, dout = _rand(15, T * K, D), _ids(16), _rand(17, T, D)
    _, _, order = dsp.permute(jnp.zeros((T, D)), jnp.asarray(ids), E)
    row = np.argsort(np.asarray(order))
    out, vjp = jax.vjp(lambda y: dsp.unpermute_sum(y, order, K, jnp.float32), jnp.asarray(ys))
    np.testing.assert_allclose(out, ys.astype(np.float64)[row].reshape(T, K, D).sum(1), **TOL)
    kept = sorted(x.size for x in jax.tree_util.tree_leaves(vjp))
    assert kept == [0, T * K], kept
    (dys,) = vjp(jnp.asarray(dout))
    np.testing.assert_array_equal(np.asarray(dys), dout[np.asarray(order) // K])
    with pytest.raises(ValueError, match=r"unpermute_sum: 7 rows are not T x K for K = 2"):
        dsp.unpermute_sum(jnp.zeros((7, D)), jnp.zeros((7,), jnp.int32), K, jnp.float32)


def test_capacity_slots_match_reference_count():
    ids = _ids(4)
    for cap in (1, 3, 5, T):
        _, keep = dsp.capacity_slots(jnp.asarray(ids), E, cap)
        np.testing.assert_array_equal(np.asarray(keep), np_ref.capacity_keep(ids, E, cap))


def test_capacity_buffers_round_trip_and_drop():
    x, ids = _rand(5, T, D), _ids(6)
    cap = 3
    pos, keep = dsp.capacity_slots(jnp.asarray(ids), E, cap)
    buf = dsp.to_buffers(jnp.asarray(x), jnp.asarray(ids), pos, E, cap)
    back = np.asarray(dsp.from_buffers(buf, jnp.asarray(ids), pos))
    expect = np.where(np.asarray(keep)[..., None], np.repeat(x[:, None], K, axis=1), 0.0)
    np.testing.assert_array_equal(back, expect)


def test_capacity_value_and_errors():
    assert dsp.capacity(16, 2, 4, 1.25) == 10  # ceil(1.25 * 16 * 2 / 4)
    assert dsp.capacity(16, 2, 4, 100.0) == 16  # clamped: an expert sees each token once at most
    with pytest.raises(ValueError, match="capacity_factor"):
        dsp.capacity(16, 2, 4, 0.0)


@pytest.mark.parametrize("shared", [0, 2])
def test_dropless_block_matches_reference(shared):
    cfg = tiny_moe(num_shared_experts=shared, shared_intermediate_size=8)
    block = _block(cfg)
    x = _rand(7, 2, 8, D)
    y, aux = _apply(block, jnp.asarray(x))
    ex = block.experts
    ref = np_ref.moe(
        x.reshape(T, D),
        block.router.w[...],
        ex.w_gate[...],
        ex.w_up[...],
        ex.w_down[...],
        K,
        True,
    )
    if shared:
        sh = block.shared
        assert sh.w_gate[...].shape == (D, 2 * 8)  # fused: n * shared_intermediate_size
        ref = ref + np_ref.swiglu(x.reshape(T, D), sh.w_gate[...], sh.w_up[...], sh.w_down[...])
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), ref, **TOL)
    logits = x.reshape(T, D) @ np.asarray(block.router.w[...], np.float64)
    _, ids, probs = np_ref.route(logits, K, True)
    lb, z = np_ref.load_balance(probs, ids), np_ref.z_loss(logits)
    np.testing.assert_allclose(aux["load_balance_loss"], lb, **TOL)
    np.testing.assert_allclose(aux["router_z_loss"], z, **TOL)
    np.testing.assert_allclose(aux["moe_loss"], 0.01 * lb + 0.001 * z, **TOL)
    assert float(aux["dropped_fraction"]) == 0.0


def test_one_expert_top1_equals_dense_swiglu():
    # E = 1, K = 1, renormalised weight = 1: the block is exactly the dense MLP. The two paths
    # differ only in matmul kernels (gmm vs dot), so f32 agreement is near machine precision.
    cfg = tiny_moe(num_experts=1, num_experts_per_tok=1, norm_topk_prob=True)
    block = _block(cfg)
    mlp = SwiGLU(
        D, 16, init_std=0.3, param_dtype=jnp.float32, dtype=jnp.float32, rngs=nnx.Rngs(params=1)
    )
    block.experts.w_gate[...] = mlp.w_gate[...][None]
    block.experts.w_up[...] = mlp.w_up[...][None]
    block.experts.w_down[...] = mlp.w_down[...][None]
    x = jnp.asarray(_rand(8, 2, 8, D))
    y, _ = _apply(block, x)
    np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(mlp, x), rtol=1e-6, atol=1e-6)


def test_capacity_large_factor_equals_dropless():
    x = jnp.asarray(_rand(9, 2, 8, D))
    y_drop, _ = _apply(_block(tiny_moe()), x)
    y_cap, aux = _apply(_block(tiny_moe(dispatch="capacity", capacity_factor=4.0)), x)
    np.testing.assert_allclose(y_cap, y_drop, **TOL)
    assert float(aux["dropped_fraction"]) == 0.0


def test_capacity_small_factor_drops_expected_assignments():
    cfg = tiny_moe(dispatch="capacity", capacity_factor=0.5)
    block = _block(cfg)
    x = _rand(10, 2, 8, D)
    y, aux = _apply(block, jnp.asarray(x))
    logits = x.reshape(T, D) @ np.asarray(block.router.w[...], np.float64)
    _, ids, _ = np_ref.route(logits, K, True)
    cap = int(np.ceil(0.5 * T * K / E))
    keep = np_ref.capacity_keep(ids, E, cap)
    assert (~keep).sum() > 0  # the test must actually drop something
    np.testing.assert_allclose(aux["dropped_fraction"], (~keep).mean(), rtol=1e-6)
    ex = block.experts
    ref = np_ref.moe(
        x.reshape(T, D),
        block.router.w[...],
        ex.w_gate[...],
        ex.w_up[...],
        ex.w_down[...],
        K,
        True,
        keep_TK=keep,
    )
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), ref, **TOL)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_block_gradients_are_finite(dispatch):
    block = _block(tiny_moe(dispatch=dispatch, capacity_factor=0.5))
    x = jnp.asarray(_rand(11, 2, 8, D))

    def loss(b):
        y, aux = b(x)
        return jnp.sum(y**2) + aux["moe_loss"]

    grads = nnx.jit(nnx.grad(loss))(block)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert np.abs(np.asarray(grads["router"]["w"][...])).sum() > 0  # learns via weights + aux
    assert np.abs(np.asarray(grads["experts"]["w_down"][...])).sum() > 0


@pytest.mark.parametrize("quantization", ["fp8_blockwise", "fp8_tensorwise"])
def test_every_quantization_recipe_runs_in_the_block(quantization):
    # A recipe is part of the Gmm the block receives, never a flag inside it: same params, the
    # block's output within FP8 error of the f32 one and finite gradients for every parameter.
    # Three chained e4m3 gmms (gate, up, down) by the max-abs ratio: measured 3.8% (blockwise)
    # and 7.2% (tensorwise: one scale for all of xs); bound 12%, as for the FP8 block under
    # sharding (test_ep.py).
    x = jnp.asarray(_rand(13, 2, 8, D))
    block = _block(tiny_moe(), kernels=KernelsConfig(quantization=quantization))
    assert block.gmm.name == f"{quantization}[blocked]" and block.gmm.fuse_gate_up
    y, aux = _apply(block, x)
    y_ref, aux_ref = _apply(_block(tiny_moe()), x)
    err = float(jnp.max(jnp.abs(y - y_ref)) / jnp.max(jnp.abs(y_ref)))
    assert err < 0.12, err
    assert float(aux["moe_loss"]) == float(aux_ref["moe_loss"])  # routing is not quantized

    def loss(b):
        y, aux = b(x)
        return jnp.sum(y**2) + aux["moe_loss"]

    grads = nnx.jit(nnx.grad(loss))(block)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert np.abs(np.asarray(grads["experts"]["w_gate"][...])).sum() > 0


def test_bad_moe_config_and_backend_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _block(tiny_moe(num_experts_per_tok=5))
    with pytest.raises(ValueError, match="dispatch"):
        _block(dataclasses.replace(tiny_moe(), dispatch="nope"))
    with pytest.raises(ValueError, match="unknown gmm backend"):
        _block(tiny_moe(), kernels=KernelsConfig(gmm_backend="nope"))
    with pytest.raises(ValueError, match="unknown quantization recipe 'fp8'"):
        _block(tiny_moe(), kernels=KernelsConfig(quantization="fp8"))
    with pytest.raises(ValueError, match="has no option 'blocksize' \\(did you mean 'block_size'"):
        _block(
            tiny_moe(),
            kernels=KernelsConfig(quantization="fp8_blockwise", recipe={"blocksize": 64}),
        )
    with pytest.raises(ValueError, match="gmm must be a kernels.gmm.Gmm"):
        MoEBlock(
            tiny_moe(),
            KERNELS,
            emb_dim=D,
            init_std=0.3,
            param_dtype=jnp.float32,
            dtype=jnp.float32,
            rngs=nnx.Rngs(params=0),
        )


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_block_gradients_match_the_float64_backward(dispatch):
    # Two independent backward paths (sort + gmm custom_vjp, scatter + einsum; capacity with
    # room for every assignment), each against the backward written out in float64
    # (np_ref.moe_sin_loss_grads: the experts, the renormalised top-k weights, the softmax, the
    # load-balance and z losses). A weight-gradient entry sums up to T * K = 32 token terms of
    # up to the leaf's largest entry (|20.8| for the router's [D, E]), so float32 rounding
    # scales with the leaf, not with the entry (a small entry is a cancelling sum): atol is
    # 1e-5 of the leaf's largest |entry| (~170 float32 ulps of it), rtol 1e-5, the tolerance
    # the two paths were held to against each other before. Measured 2026-11-30 on a 2-core
    # AVX2 EPYC: at most 1.8e-6 of the scale over both paths and every leaf. Either aux
    # loss's gradient off by a constant factor in the oracle fails it (checked).
    x = jnp.asarray(_rand(12, 2, 8, D))
    cfg = tiny_moe() if dispatch == "dropless" else tiny_moe(dispatch=dispatch, capacity_factor=4.0)
    block = _block(cfg)

    def loss(b, x):
        y, aux = b(x)
        return jnp.sum(jnp.sin(y)) + aux["moe_loss"]

    g, gx = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(block, x)
    ex = block.experts
    ref = np_ref.moe_sin_loss_grads(
        np.asarray(x).reshape(T, D),
        block.router.w[...],
        ex.w_gate[...],
        ex.w_up[...],
        ex.w_down[...],
        K,
        cfg.aux_loss_weight,
        cfg.z_loss_weight,
    )
    got = {
        "x": np.asarray(gx).reshape(T, D),
        "router": g["router"]["w"][...],
        **{name: g["experts"][name][...] for name in ("w_gate", "w_up", "w_down")},
    }
    assert len(jax.tree.leaves(g)) == len(ref) - 1  # every weight has its oracle (and x)
    for name, want in ref.items():
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(
            np.asarray(got[name]), want, rtol=TOL["rtol"], atol=TOL["atol"] * scale, err_msg=name
        )
