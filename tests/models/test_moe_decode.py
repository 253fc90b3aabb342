"""The decode MoE path (prefused gate|up, gathered or grouped) equals the training layer."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, TINY_MOE, tiny

from moetext import models
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
