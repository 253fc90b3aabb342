"""Splash attention (models/layers/splash.py) equals the XLA `attend` it replaces on TPU, and
model.attention_kernel selects it.

Legend: B batch, S positions, N query heads, K kv heads, H q/k head dim, V v head dim.

The oracle is `models/layers/attention.py: attend` on its XLA path (itself checked against a
NumPy reference in tests/models/test_layers.py). Splash runs through Pallas' interpreter on CPU,
the same kernel bodies Mosaic compiles on TPU. S = 256 with 128-wide blocks: a 2 x 2 block grid
whose upper block the causal mask skips. Rows of segment 0 (padding) are left out of every
comparison: their output is junk on both paths (the kernel module's docstring says why), and the
loss weights them 0, so no gradient flows from them on either.

The 8-device check runs in a fresh interpreter (splash_worker.py); the last test compiles for a
v5p chip with libtpu (marked tpu_aot).
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from fake_devices import run_worker
from moetext import hlo_cost
from moetext.aot import TOPOLOGY_BY_CHIP, tpu_devices
from moetext.config.loader import from_dict
from moetext.config.schema import ModelConfig
from moetext.errors import ConfigError
from moetext.kernels.pallas import target
from moetext.models.layers import splash
from moetext.models.layers.attention import Attention, attend, splash_wanted
from moetext.models.layers.rope import rope_cos_sin

# float32 throughout. Splash scales q before the dot and normalises after the PV product with
# an online softmax over 128-key blocks; the XLA path scales the scores and normalises once, so
# the two round differently. Measured max |splash - xla| / max |xla|: <= 1.8e-6 on outputs and
# gradients (8 devices: <= 8.2e-7). Bound: 1e-5 (~5x the worst seen).
REL_TOL = 1e-5

# name: (B, S, N, K, H, V, packed segments, scale)
CASES = {
    "causal_gqa": (2, 256, 4, 2, 64, 64, False, None),
    "packed_padding_gqa_scale": (2, 256, 4, 2, 64, 64, True, 0.3),
    "mha_v_head_dim": (1, 256, 2, 2, 64, 32, True, None),
}


def _rel(a, b, rows):
    a, b = np.asarray(a, np.float64)[rows], np.asarray(b, np.float64)[rows]
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _inputs(b, s, n, k, h, v, packed):
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(b, s, n, h)), jnp.float32)
    kk = jnp.asarray(r.normal(size=(b, s, k, h)), jnp.float32)
    vv = jnp.asarray(r.normal(size=(b, s, k, v)), jnp.float32)
    seg = None
    if packed:  # row 0: two documents, padding at the end; row 1: one document, padded
        ids = np.ones((b, s), np.int32)
        ids[0, 100:230], ids[0, 230:] = 2, 0
        if b > 1:
            ids[1, 200:] = 0
        seg = jnp.asarray(ids)
    w = jnp.asarray(r.normal(size=(b, s, n, v)), jnp.float32)  # loss weights of the outputs
    return q, kk, vv, seg, w


@pytest.mark.parametrize("name", list(CASES))
def test_splash_matches_xla_attend(name):
    b, s, n, k, h, v, packed, scale = CASES[name]
    q, kk, vv, seg, w = _inputs(b, s, n, k, h, v, packed)
    real = np.ones((b, s), bool) if seg is None else np.asarray(seg) != 0
    w = w * jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(kernel):
        def f(q, kk, vv):
            out = attend(q, kk, vv, seg, scale=scale, kernel=kernel)
            return jnp.sum(out * w), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, kk, vv)

    (_, out_s), grads_s = loss("splash")
    (_, out_x), grads_x = loss("xla")
    assert out_s.shape == (b, s, n, v)
    assert _rel(out_s, out_x, real) < REL_TOL
    # dq of padding queries is junk-times-zero on both paths; dk, dv are compared over all keys
    # (padding keys get no gradient from real queries on either path).
    everything = np.ones((b, s), bool)
    for got, want, rows in zip(grads_s, grads_x, (real, everything, everything), strict=True):
        assert _rel(got, want, rows) < REL_TOL


def test_splash_runs_a_pallas_call_and_xla_does_not():
    q, kk, vv, seg, _ = _inputs(1, 256, 2, 1, 64, 64, True)
    jaxpr = lambda kernel: str(jax.make_jaxpr(lambda *a: attend(*a, kernel=kernel))(q, kk, vv, seg))
    assert "pallas_call" in jaxpr("splash")
    assert "pallas_call" not in jaxpr("xla")
    assert "pallas_call" not in jaxpr("auto")  # CPU, not compiling for a TPU


def test_auto_picks_splash_for_tpu_targets_only():
    assert splash_wanted("splash") and not splash_wanted("xla")
    assert splash_wanted("auto") == (jax.default_backend() == "tpu")
    with target.compiling_for("v5p"):
        assert splash_wanted("auto") and not splash_wanted("xla")
    with pytest.raises(ValueError, match="'flash'"):
        splash_wanted("flash")


def test_shapes_splash_cannot_take_stay_on_xla(caplog):
    q, kk, vv, seg, _ = _inputs(1, 200, 2, 1, 64, 64, True)
    assert "not a multiple of 128" in (splash.unfit_reason(q, kk, vv) or "")
    with caplog.at_level(logging.WARNING):
        out = attend(q, kk, vv, seg, kernel="splash")  # falls back to XLA: no interpreter run
    assert "stays on XLA, not splash: sequence length 200" in caplog.text
    jaxpr = str(jax.make_jaxpr(lambda *a: attend(*a, kernel="splash"))(q, kk, vv, seg))
    assert "pallas_call" not in jaxpr
    np.testing.assert_array_equal(out, attend(q, kk, vv, seg, kernel="xla"))
    with pytest.raises(ValueError, match="not a multiple of 128"):
        splash.splash_attend(q, kk, vv, seg)
    # decoding with a cache (mask_BST) is XLA's, whatever the kernel
    mask = jnp.tril(jnp.ones((1, 200, 200), bool))
    decode = str(jax.make_jaxpr(lambda *a: attend(*a, mask_BST=mask, kernel="splash"))(q, kk, vv))
    assert "pallas_call" not in decode


def test_model_config_selects_the_kernel():
    assert ModelConfig().attention_kernel == "auto"
    cfg = ModelConfig(emb_dim=32, num_heads=2, num_kv_heads=1, head_dim=64, dtype="float32")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 128, 32)), jnp.float32)
    cos, sin = rope_cos_sin(jnp.arange(128)[None], 64, cfg.rope_theta)
    for kernel, pallas in (("splash", True), ("xla", False), ("auto", False)):
        kcfg = dataclasses.replace(cfg, attention_kernel=kernel)
        attn = Attention(kcfg, rngs=nnx.Rngs(params=0))
        assert ("pallas_call" in str(jax.make_jaxpr(attn)(x, cos, sin))) == pallas
    with pytest.raises(ConfigError, match="attention_kernel"):
        from_dict({"model": {"attention_kernel": "flash"}})


def test_splash_under_8_device_rules_matches_single_device():
    r = run_worker("tests.models.splash_worker", timeout_s=600)
    assert r["shard_map"], "the sharded call did not run per shard"
    for key, value in r["rel"].items():
        assert value < REL_TOL, (key, value)


@pytest.mark.tpu_aot
def test_splash_compiles_with_mosaic_for_v5p_and_step_cost_counts_it():
    """Ahead of time for one v5p chip (libtpu, no TPU): the forward and backward lower as Mosaic
    kernels (tpu_custom_call), and step_cost counts their FLOPs by shape (splash carries no
    pl.CostEstimate): forward 4, dq 6, dkv 8 x N x S x S x H x 1/2 (causal)."""
    b, s, n, k, h = 1, 1024, 4, 2, 128
    device = tpu_devices(TOPOLOGY_BY_CHIP["v5p"])[0]
    sharding = SingleDeviceSharding(device)
    bf16 = jnp.bfloat16
    args = [
        jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
        for shape, dt in (
            ((b, s, n, h), bf16),
            ((b, s, k, h), bf16),
            ((b, s, k, h), bf16),
            ((b, s), jnp.int32),
        )  # fmt: skip
    ]

    def loss(q, kk, vv, seg):
        return jnp.sum(attend(q, kk, vv, seg, kernel="auto").astype(jnp.float32))

    with target.compiling_for("v5p"):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, dq, dkv
    cost = hlo_cost.hlo_cost(text)
    assert cost.pallas_calls_without_estimate == 0
    assert cost.flops >= (4 + 6 + 8) * n * s * s * h * 0.5
