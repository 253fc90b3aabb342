"""The decode MoE path (prefused gate|up, gathered or grouped) equals the training layer."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, TINY_MOE, tiny

from moetext import models
from moetext.kernels.pallas import target
from moetext.models.moe import decode as moe_decode
from moetext.models.moe.block import MoEBlock
from moetext.models.moe.experts import gmm_from_config


def _block(**moe_changes) -> MoEBlock:
    cfg = dataclasses.replace(TINY_MOE, **moe_changes)
    return MoEBlock(
        cfg,
        gmm_from_config(KERNELS),
        emb_dim=32,
        init_std=0.1,
        param_dtype=np.float32,
        dtype=np.float32,
        rngs=nnx.Rngs(params=1),
        shared_expert_gate=cfg.shared_expert_gate,
    )


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"norm_topk_prob": False},
        {"num_shared_experts": 1, "shared_intermediate_size": 24, "shared_expert_gate": True},
    ],
    ids=["renorm", "no-renorm", "gated-shared"],
)
@pytest.mark.parametrize("tokens", [1, 3, 200], ids=["T1", "T3", "T200"])
def test_prefused_paths_equal_the_training_layer(changes, tokens, monkeypatch):
    x = jax.random.normal(jax.random.key(0), (1, tokens, 32))
    want = np.asarray(_block(**changes)(x)[0])
    fused = _block(**changes)
    moe_decode.prefuse(fused.experts)
    assert not hasattr(fused.experts, "w_gate") and fused.experts.w_gate_up.shape == (4, 32, 32)
    # float32; the paths sum D (and F) in different orders: 1e-5 on outputs of magnitude ~1.
    for rows in (0, 10**6):  # grouped only; gathered only
        monkeypatch.setattr(moe_decode, "GATHER_BELOW", rows)
        got = np.asarray(jax.jit(lambda x: fused.decode(x))(x))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_prefuse_all_finds_every_moe_layer_and_logits_stay():
    model = models.build(tiny(), TINY_MOE, KERNELS, rngs=nnx.Rngs(params=0))
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % 128
    caches = model.init_cache(2, 8)
    first = np.zeros(2, np.int32)
    positions = np.broadcast_to(np.arange(6, dtype=np.int32), (2, 6))
    want, _ = model.cached(tokens, positions, caches, 0, first)
    assert moe_decode.prefuse_all(model) == 2  # tiny(): dense, MoE, MoE
    got, _ = model.cached(tokens, positions, model.init_cache(2, 8), 0, first)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_a_prefused_model_still_runs_its_forward():
    model = models.build(tiny(), TINY_MOE, KERNELS, rngs=nnx.Rngs(params=0))
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % 128
    want = np.asarray(model(tokens)[0])
    moe_decode.prefuse_all(model)
    np.testing.assert_array_equal(np.asarray(model(tokens)[0]), want)  # halves of w_gate_up


@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["T1", "T3", "T40"])
def test_fused_kernel_equals_the_loop_path(tokens, monkeypatch):
    # 40 rows x top-2 > 4 experts: every expert active, the loop path runs grouped matmuls.
    x = jax.random.normal(jax.random.key(1), (1, tokens, 32))
    calls = []
    kernel = moe_decode.fused_kernel.fused_moe
    monkeypatch.setattr(
        moe_decode.fused_kernel, "fused_moe", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    changes = {"num_shared_experts": 1, "shared_intermediate_size": 24}
    loop, fused = _block(**changes), _block(**changes)
    moe_decode.prefuse(loop.experts, "loop")
    moe_decode.prefuse(fused.experts, "fused")  # interpreted on CPU
    want = np.asarray(jax.jit(lambda x: loop.decode(x))(x))
    got = np.asarray(jax.jit(lambda x: fused.decode(x))(x))
    assert calls == [1]  # the kernel ran for the fused block only
    # float32; F and the K experts are summed in different orders: 1e-5 on outputs ~1.
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_fused_decode_logits_equal_the_loop_path():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (3, 1)).astype(np.int32)
    positions = np.full((3, 1), 4, np.int32)
    first = np.zeros(3, np.int32)
    logits = {}
    for kernel in ("loop", "fused"):
        model = models.build(tiny(), TINY_MOE, KERNELS, rngs=nnx.Rngs(params=0))
        moe_decode.prefuse_all(model, kernel)
        logits[kernel], _ = model.cached(tokens, positions, model.init_cache(3, 8), 4, first)
    # float32 end to end: 1e-5 on logits of magnitude ~1.
    np.testing.assert_allclose(
        np.asarray(logits["fused"]), np.asarray(logits["loop"]), atol=1e-5, rtol=0
    )


def test_auto_is_fused_only_for_tpu_code_and_few_rows():
    assert not moe_decode.use_fused("auto", 8, 4, 256)  # CPU
    with target.compiling_for("v6e"):
        assert moe_decode.use_fused("auto", 8, 4, 256)
        assert not moe_decode.use_fused("auto", moe_decode.FUSED_MAX_ROWS + 1, 4, 256)  # prefill
        assert not moe_decode.use_fused("auto", 8, 4, 64)  # F below Mosaic's 128 lanes
        assert not moe_decode.use_fused("loop", 8, 4, 256)
    assert moe_decode.use_fused("fused", 8, 4, 64)


def test_unknown_decode_kernel_raises():
    with pytest.raises(ValueError, match=r"unknown kernels.decode_moe 'fast'; valid: auto"):
        moe_decode.prefuse(_block().experts, "fast")
