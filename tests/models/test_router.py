"""The router seam: the registry, softmax_topk against a float64 NumPy oracle, and routers
registered here (a fixed one, a stateful one) run by the unchanged MoE block and model.

float32 routing against float64 references: a handful of f32 ops on O(1) values, so
rtol = atol = 1e-5 (as tests/models/test_moe.py).
"""

import jax
import jax.numpy as jnp
import np_ref
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, tiny, tiny_moe

from moetext import models
from moetext.errors import ConfigError
from moetext.models.moe import (
    AUX_KEYS,
    LOAD_KEY,
    MoEBlock,
    Router,
    Routing,
    available_routers,
    build_router,
    expert_load,
    get_router,
    gmm_from_config,
    register_router,
)

TOL = dict(rtol=1e-5, atol=1e-5)
T, D, E, K = 16, 32, 4, 2


class Fixed(Router):
    """Token t goes to experts (s_t + j) mod E, j < K, with weight 1/K each, s_t its segment id
    (0 without): no parameters, no losses."""

    def __init__(self, cfg, *, emb_dim, init_std, param_dtype, rngs):
        del emb_dim, init_std, param_dtype, rngs
        self.e, self.k = cfg.num_experts, cfg.num_experts_per_tok

    def __call__(self, x_TD, *, segment_ids_BS=None):
        t = x_TD.shape[0]
        seg_T = jnp.zeros((t,), jnp.int32) if segment_ids_BS is None else segment_ids_BS.ravel()
        ids_TK = ((seg_T[:, None] + jnp.arange(self.k)[None]) % self.e).astype(jnp.int32)
        zero = jnp.zeros((), jnp.float32)
        return Routing(
            jnp.full((t, self.k), 1.0 / self.k, jnp.float32),
            ids_TK,
            moe_loss=zero,
            losses={"load_balance_loss": zero, "router_z_loss": zero},
            metrics={
                "expert_load": expert_load(ids_TK, self.e),
                "expert_counts": expert_load(ids_TK, self.e) * ids_TK.size,
            },
        )


class Tally(nnx.Variable):
    """Model state the optimizer never sees (not an nnx.Param)."""


class Counting(Fixed):
    """Fixed routing that sums the expert loads it is given in update_state."""

    def __init__(self, cfg, **dims):
        super().__init__(cfg, **dims)
        self.load_sum = Tally(jnp.zeros((cfg.num_experts,), jnp.float32))
        self.updates = Tally(jnp.zeros((), jnp.int32))

    def update_state(self, metrics):
        self.load_sum[...] = self.load_sum[...] + metrics["expert_load"]
        self.updates[...] = self.updates[...] + 1


class TooMany(Fixed):
    """Returns K + 1 experts per token: a broken router."""

    def __call__(self, x_TD, *, segment_ids_BS=None):
        r = Fixed.__call__(self, x_TD, segment_ids_BS=segment_ids_BS)
        ids = jnp.concatenate([r.ids_TK, r.ids_TK[:, :1]], axis=1)
        return Routing(jnp.ones(ids.shape), ids, r.moe_loss, r.losses, r.metrics)


register_router("test_fixed")(Fixed)
register_router("test_counting")(Counting)
register_router("test_too_many")(TooMany)


def _rand(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _block(router_name, seed=0, **moe_changes):
    cfg = tiny_moe(router=router_name, **moe_changes)
    dims = dict(emb_dim=D, init_std=0.3, param_dtype=jnp.float32)
    rngs = nnx.Rngs(params=seed)
    router = build_router(cfg, **dims, rngs=rngs)
    return MoEBlock(
        cfg, gmm_from_config(KERNELS), router=router, dtype=jnp.float32, **dims, rngs=rngs
    )


_apply = nnx.jit(lambda block, x, seg: block(x, seg))


def test_registry_names_the_valid_routers_and_the_nearest():
    assert "softmax_topk" in available_routers()
    with pytest.raises(ConfigError) as e:
        get_router("sofmax_topk")
    msg = str(e.value)
    assert "unknown moe.router 'sofmax_topk' (did you mean 'softmax_topk'?)" in msg
    assert f"valid routers: {', '.join(available_routers())}" in msg
    with pytest.raises(ConfigError, match="unknown moe.router 'nope'; valid routers: .*softmax"):
        get_router("nope")


def test_an_unknown_router_fails_the_model_build_with_a_config_error():
    with pytest.raises(ConfigError, match="did you mean 'softmax_topk'"):
        models.build(tiny(), tiny_moe(router="softmax_top_k"), KERNELS, rngs=nnx.Rngs(params=0))


def test_a_second_router_of_one_name_is_refused():
    with pytest.raises(ValueError, match="'softmax_topk' is already registered"):
        register_router("softmax_topk")(Fixed)
    assert register_router("test_fixed")(Fixed) is Fixed  # the same class again: a no-op
    with pytest.raises(ValueError, match="must be a Python identifier"):
        register_router("soft-max")


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_the_float64_reference(norm):
    router = build_router(
        tiny_moe(norm_topk_prob=norm),
        emb_dim=D,
        init_std=0.3,
        param_dtype=jnp.float32,
        rngs=nnx.Rngs(params=0),
    )
    w = np.asarray(router.w[...]).copy()
    w[:, 3] = w[:, 1]  # experts 1 and 3 always tie: top-k must pick 1 first
    router.w[...] = jnp.asarray(w)
    x = _rand(1, T, D)
    x[:3] = 0.0  # all four logits 0: ties everywhere, experts 0 and 1 win
    r = nnx.jit(lambda m, x: m(x))(router, jnp.asarray(x))

    logits = x.astype(np.float64) @ w.astype(np.float64)
    w_ref, ids_ref, probs_ref = np_ref.route(logits, K, norm)
    np.testing.assert_array_equal(r.ids_TK, ids_ref)
    # The oracle's stable sort gives ties to the lower id; check the cases are there.
    assert (ids_ref[:3] == [0, 1]).all()
    assert ((ids_ref == 3).any(1) == (ids_ref == [1, 3]).all(1)).all()  # 3 only after 1
    assert (ids_ref == [1, 3]).all(1).any()
    np.testing.assert_allclose(r.weights_TK, w_ref, **TOL)
    assert r.weights_TK.dtype == jnp.float32 and r.ids_TK.dtype == jnp.int32
    lb, z = np_ref.load_balance(probs_ref, ids_ref), np_ref.z_loss(logits)
    np.testing.assert_allclose(r.losses["load_balance_loss"], lb, **TOL)
    np.testing.assert_allclose(r.losses["router_z_loss"], z, **TOL)
    np.testing.assert_allclose(r.moe_loss, 0.01 * lb + 0.001 * z, **TOL)  # tiny_moe's weights
    load = np.bincount(ids_ref.ravel(), minlength=E) / ids_ref.size
    np.testing.assert_array_equal(r.metrics["expert_load"], load.astype(np.float32))


def test_softmax_topk_keeps_its_parameter_path_and_axes():
    # Checkpoints and the HF tensor map name the gate ...mlp.router.w, [D, E], ("embed", None).
    model = models.build(tiny(), tiny_moe(), KERNELS, rngs=nnx.Rngs(params=0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert params["layers"][1]["mlp"]["router"] == {"w": model.layers[1].mlp.router.w[...]}
    w = model.layers[1].mlp.router.w
    assert w.shape == (D, E) and w.get_metadata()["out_sharding"] == ("embed", None)


def test_the_block_runs_a_router_registered_here():
    # The block reads only the Routing: with fixed routing, token t sums experts 0..K-1 with
    # weights 1/K, and the aux has the keys and shapes softmax_topk's has.
    block = _block("test_fixed")
    assert isinstance(block.router, Fixed) and not nnx.state(block.router, nnx.Param)
    x = _rand(2, 2, 8, D)
    y, aux = _apply(block, jnp.asarray(x), None)
    ex = block.experts
    x_TD = x.reshape(T, D)
    ref = sum(
        np_ref.swiglu(x_TD, ex.w_gate[...][e], ex.w_up[...][e], ex.w_down[...][e]) / K
        for e in range(K)
    )
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), ref, **TOL)
    _, aux_softmax = _apply(_block("softmax_topk"), jnp.asarray(x), None)
    assert {k: v.shape for k, v in aux.items()} == {k: v.shape for k, v in aux_softmax.items()}
    np.testing.assert_array_equal(aux["expert_load"], [0.5, 0.5, 0.0, 0.0])
    assert float(aux["moe_loss"]) == 0.0


def test_segment_ids_reach_the_router():
    block = _block("test_fixed")
    seg = np.repeat(np.arange(4, dtype=np.int32), 4).reshape(2, 8)  # tokens t // 4 -> segment
    _, aux = _apply(block, jnp.asarray(_rand(3, 2, 8, D)), jnp.asarray(seg))
    # Segment s sends its 4 tokens to experts s and s + 1 (mod 4): every expert gets 8 of 32.
    np.testing.assert_array_equal(aux["expert_load"], [0.25] * 4)


@pytest.mark.parametrize(
    "scan", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unrolled", "scanned"]
)
def test_a_model_with_a_registered_router_keeps_the_aux_keys_and_shapes(scan):
    # The model's aux with softmax_topk (tests/models/test_decoder.py): the block's scalars and
    # expert_load [num_moe_layers, E]; tiny() is dense, MoE, MoE.
    model = models.build(
        tiny(scan_layers=scan), tiny_moe(router="test_fixed"), KERNELS, rngs=nnx.Rngs(params=0)
    )
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % 128
    _, aux = nnx.jit(lambda m, t: m(t))(model, tokens)
    want = {k: ((), jnp.float32) for k in AUX_KEYS} | {
        LOAD_KEY: ((2, E), jnp.float32),
        "expert_counts": ((2, E), jnp.float32),
    }
    assert {k: (v.shape, v.dtype) for k, v in aux.items()} == want
    np.testing.assert_array_equal(aux[LOAD_KEY], [[0.5, 0.5, 0.0, 0.0]] * 2)


def test_update_state_changes_only_non_parameter_state():
    block = _block("test_counting")
    params_before = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    assert "router" not in params_before  # Counting has no parameters, only Tally state
    assert set(nnx.to_pure_dict(nnx.state(block, Tally))["router"]) == {"load_sum", "updates"}
    update = nnx.jit(lambda b, aux: b.update_state(aux))
    seg = np.zeros((2, 8), np.int32)
    seg[1] = 2
    _, aux = _apply(block, jnp.asarray(_rand(4, 2, 8, D)), jnp.asarray(seg))
    update(block, aux)
    update(block, aux)
    assert int(block.router.updates[...]) == 2
    np.testing.assert_array_equal(block.router.load_sum[...], 2 * np.asarray(aux["expert_load"]))
    params_after = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, params_after, params_before)


def test_the_default_update_state_changes_nothing():
    block = _block("softmax_topk")
    before = nnx.to_pure_dict(nnx.state(block))
    _, aux = _apply(block, jnp.asarray(_rand(5, 2, 8, D)), None)
    nnx.jit(lambda b, aux: b.update_state(aux))(block, aux)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(block)), before)


def test_the_block_refuses_a_routing_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"TooMany returned ids \(16, 3\).*\[T, K\] = \[16, 2\]"):
        _apply(_block("test_too_many"), jnp.asarray(_rand(6, 2, 8, D)), None)
    with pytest.raises(ValueError, match="router must be a models.moe.routers.Router"):
        MoEBlock(
            tiny_moe(),
            gmm_from_config(KERNELS),
            router=object(),
            emb_dim=D,
            init_std=0.3,
            param_dtype=jnp.float32,
            dtype=jnp.float32,
            rngs=nnx.Rngs(params=0),
        )


def test_unknown_names_fail_before_anything_is_built():
    from moetext import models
    from moetext.config.schema import ModelConfig, MoEConfig

    models.check_names(ModelConfig(), MoEConfig())
    with pytest.raises(ConfigError, match=r"unknown moe.router 'sofmax_topk' \(did you mean"):
        models.check_names(ModelConfig(), MoEConfig(router="sofmax_topk"))
    with pytest.raises(ConfigError, match=r"model.family='qwen4' is not a registered"):
        models.check_names(ModelConfig(family="qwen4"), MoEConfig())
