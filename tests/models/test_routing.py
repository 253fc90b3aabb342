"""Issue 29's routing against float64 NumPy oracles (np_ref.py): sigmoid_topk (DeepSeek-V3's
gate) and group-limited softmax_topk, ties included; the balance-loss scopes and the z-loss with
padding left out; the aux-loss-free bias update through the real train step; routing_override;
the config errors and resume rules of the routing fields.

float32 routing against float64 references: a handful of f32 ops on O(1) values, so
rtol = atol = 1e-5 (as test_router.py). Expert ids and selection biases are compared exactly:
ids are chosen from values that differ by far more than f32 rounding (or tie exactly), and the
bias moves by rate * sign(integer counts), one rounding per step in both.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import np_ref
import numpy as np
import pytest
from flax import nnx
from tiny_configs import tiny_moe

from moetext import config, program
from moetext import data as data_lib
from moetext.checkpoint.config_check import check_config
from moetext.checkpoint.errors import CheckpointError
from moetext.config import to_dict
from moetext.errors import ConfigError
from moetext.models.moe import MoEBlock, build_router, gmm_from_config
from moetext.models.moe.block import IDS_KEY, capture_expert_ids
from moetext.program.step import make_accumulate, make_loss_fn
from tiny_configs import KERNELS

TOL = dict(rtol=1e-5, atol=1e-5)
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
B, S, D, E, K = 2, 16, 16, 8, 2
# Two packed rows: documents 1, 2 then padding; documents 1, 3 then padding.
SEG_BS = np.array([[1] * 5 + [2] * 7 + [0] * 4, [1] * 10 + [3] * 3 + [0] * 3], np.int32)


def _router(**moe):
    cfg = tiny_moe(num_experts=E, num_experts_per_tok=K, **moe)
    return build_router(cfg, emb_dim=D, init_std=0.5, param_dtype=jnp.float32, rngs=nnx.Rngs(0))


def _tied(router) -> None:
    """Exact ties: group 1 (experts 2, 3) is a copy of group 0 (experts 0, 1), and expert 5 of
    expert 4, in the gate and in the bias."""
    w = np.array(router.w[...])
    w[:, 2:4], w[:, 5] = w[:, 0:2], w[:, 4]
    router.w[...] = jnp.asarray(w)
    if hasattr(router, "selection_bias"):
        bias = np.linspace(-0.05, 0.05, E).astype(np.float32)
        bias[2:4], bias[5] = bias[0:2], bias[4]
        router.selection_bias[...] = jnp.asarray(bias)


def _x(seed=1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (B * S, D), jnp.float32)


@pytest.mark.parametrize(
    "n_group,topk_group,norm,scale",
    [(1, 1, True, 1.0), (4, 2, True, 2.5), (4, 2, False, 2.5), (4, 1, True, 1.0)],
)
def test_sigmoid_topk_is_deepseek_v3s_gate_ties_included(n_group, topk_group, norm, scale):
    r = _router(
        router="sigmoid_topk",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    _tied(r)
    x = _x()
    routing, logits = r(x), np.asarray(r.logits(x))
    w, ids, scores = np_ref.sigmoid_gate(
        logits, np.asarray(r.selection_bias[...]), K, n_group, topk_group, norm, scale
    )
    np.testing.assert_array_equal(np.asarray(routing.ids_TK), ids)
    np.testing.assert_allclose(np.asarray(routing.weights_TK), w, **TOL)
    # Ties go to the lower id: a copy is chosen only beside its original, and some tie was
    # decided (an original chosen without its copy).
    has = {i: (np.asarray(routing.ids_TK) == i).any(-1) for i in range(E)}
    for copy, orig in ((2, 0), (3, 1), (5, 4)):
        assert not (has[copy] & ~has[orig]).any(), (copy, orig)
    assert (has[0] & ~has[2]).any() or (has[4] & ~has[5]).any()
    # The balance loss averages the per-token normalised scores.
    probs = scores / scores.sum(-1, keepdims=True)
    want = np_ref.switch_balance(probs, ids, np.ones(B * S))
    np.testing.assert_allclose(float(routing.losses["load_balance_loss"]), want, **TOL)


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (2, 1, False)])
def test_softmax_topk_with_groups_is_group_limited_greedy(n_group, topk_group, norm):
    r = _router(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    _tied(r)
    x = _x(2)
    routing = r(x)
    w, ids, _ = np_ref.softmax_group_gate(np.asarray(r.logits(x)), K, n_group, topk_group, norm)
    np.testing.assert_array_equal(np.asarray(routing.ids_TK), ids)
    np.testing.assert_allclose(np.asarray(routing.weights_TK), w, **TOL)


@pytest.mark.parametrize("name", ["softmax_topk", "sigmoid_topk"])
def test_balance_loss_scopes_and_z_loss_leave_padding_out(name):
    x, seg = _x(3), jnp.asarray(SEG_BS)
    valid = SEG_BS.reshape(-1) > 0
    r = _router(router=name)
    routing = r(x, segment_ids_BS=seg)
    logits, ids = np.asarray(r.logits(x)), np.asarray(routing.ids_TK)
    probs = np_ref.softmax(logits)
    if name == "sigmoid_topk":
        s = 1.0 / (1.0 + np.exp(-np_ref.f64(logits)))
        probs = s / s.sum(-1, keepdims=True)
    lb = float(routing.losses["load_balance_loss"])
    np.testing.assert_allclose(lb, np_ref.switch_balance(probs, ids, valid), **TOL)
    z = float(routing.losses["router_z_loss"])
    np.testing.assert_allclose(z, np_ref.masked_z_loss(logits, valid), **TOL)
    counts = np.asarray(routing.metrics["expert_counts"])
    np.testing.assert_array_equal(counts, np_ref.counts(ids, valid, E))
    assert counts.sum() == K * valid.sum()  # padding's assignments are not counted

    seq = _router(router=name, aux_loss_scope="sequence")
    got = float(seq(x, segment_ids_BS=seg).losses["load_balance_loss"])
    np.testing.assert_allclose(got, np_ref.sequence_balance(probs, ids, SEG_BS, K), **TOL)

    glob = _router(router=name, aux_loss_scope="global_batch")
    # An empty buffer (the first micro-batch, or grad_accum_steps=1): the micro-batch loss.
    assert float(glob(x, segment_ids_BS=seg).losses["load_balance_loss"]) == pytest.approx(
        lb, rel=1e-6
    )
    prior = np.array([3, 0, 7, 1, 0, 2, 5, 4], np.float32)
    glob.load_prior[...] = jnp.asarray(prior)
    got = float(glob(x, segment_ids_BS=seg).losses["load_balance_loss"])
    np.testing.assert_allclose(got, np_ref.switch_balance(probs, ids, valid, prior), **TOL)


def test_bias_update_rule_and_initial_bias():
    init = tuple(float(v) for v in np.linspace(-0.2, 0.3, E))
    r = _router(router="sigmoid_topk", bias_update_rate=0.01, initial_bias=init)
    np.testing.assert_array_equal(np.asarray(r.selection_bias[...]), np.float32(init))
    counts = np.array([5, 3, 4, 4, 0, 9, 4, 3], np.float32)  # mean 4: three at 0
    r.update_state({"expert_counts": jnp.asarray(counts)})
    want = np.float32(init) + np.float32(0.01) * np.sign(counts.mean() - counts, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(r.selection_bias[...]), want)
    np.testing.assert_allclose(want, np_ref.bias_update(init, counts, 0.01), rtol=1e-6)
    still = _router(router="sigmoid_topk", initial_bias=init)
    still.update_state({"expert_counts": jnp.asarray(counts)})
    np.testing.assert_array_equal(np.asarray(still.selection_bias[...]), np.float32(init))
