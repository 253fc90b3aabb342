"""Analytic parameter counts and FLOPs: a hand count of the tiny config and the built model."""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_configs import KERNELS, TINY_MOE, tiny

from moetext import models
from moetext.config import load
from moetext.models.flops import count_params, flops_per_token


def _hand_count(tied: bool):
    # tiny(): V=128, D=32, 3 layers (dense, MoE, MoE), N=4 heads, KV=2, H=8, mlp 64, qk_norm;
    # MoE: E=4, K=2, F=16, no shared experts.
    attn = 32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 2 * 8  # q, k, v, o, q/k norms
    per_layer = attn + 2 * 32  # + two pre-norms
    dense = 3 * 32 * 64
    expert = 3 * 32 * 16
    router = 32 * 4
    embedding = 128 * 32
    head = 0 if tied else 32 * 128
    total = embedding + head + 32 + 3 * per_layer + dense + 2 * (router + 4 * expert)
    active = total - 2 * (4 - 2) * expert
    return total, active, embedding


def test_count_params_matches_hand_count_and_built_model():
    for tied in (False, True):
        cfg = tiny(tie_embeddings=tied)
        total, active, embedding = _hand_count(tied)
        assert count_params(cfg, TINY_MOE) == {
            "total": total,
            "active": active,
            "embedding": embedding,
        }
    model = nnx.eval_shape(lambda: models.build(tiny(), TINY_MOE, KERNELS, rngs=nnx.Rngs(0)))
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert built == _hand_count(False)[0]


def test_flops_per_token_hand_count():
    total, active, embedding = _hand_count(False)
    attention = 12 * 3 * 4 * 8 * 16  # 12 * layers * heads * head_dim * seq_len
    assert flops_per_token(tiny(), TINY_MOE, 16) == 6 * (active - embedding) + attention
    # Tied: the head matmul still costs D*V per token though the table is counted once.
    total_t, active_t, emb_t = _hand_count(True)
    expect = 6 * (active_t - emb_t + 32 * 128) + attention
    assert flops_per_token(tiny(tie_embeddings=True), TINY_MOE, 16) == expect


def test_dense_family_counts_no_experts():
    counts = count_params(tiny(family="dense"), TINY_MOE)
    assert counts["total"] == counts["active"]


MODEL_YAMLS = sorted((Path(__file__).resolve().parents[2] / "configs" / "models").glob("*.yml"))


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda p: p.stem)
def test_shipped_model_configs_build_abstractly_with_counted_params(path):
    # eval_shape traces the build without allocating, so even the 235B config is cheap.
    cfg = load(path)
    model = nnx.eval_shape(
        lambda: models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=0))
    )
    built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert built == count_params(cfg.model, cfg.moe)["total"]
