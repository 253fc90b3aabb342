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
from tiny_configs import KERNELS, tiny_moe

from moetext import config, program
from moetext import data as data_lib
from moetext.checkpoint.config_check import check_config
from moetext.checkpoint.errors import CheckpointError
from moetext.config import to_dict
from moetext.errors import ConfigError
from moetext.models.moe import MoEBlock, build_router, gmm_from_config
from moetext.models.moe.block import IDS_KEY, capture_expert_ids
from moetext.program.step import make_accumulate, make_loss_fn

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


# The tiny config's real train step (2 MoE layers of 8 experts), synthetic data, one device.
STEP = [
    "data.kind=synthetic",
    "checkpoint.enabled=false",
    "train.progress_bar=false",
    "train.grad_accum_steps=2",
]
INIT = [0.3, -0.1, 0.0, 0.2, -0.3, 0.1, 0.0, -0.2]


def _built(*overrides):
    cfg = config.load(TINY, [*STEP, *overrides])
    return cfg, program.build(cfg, jax.devices()[:1])


def _padded_batch(cfg) -> dict[str, np.ndarray]:
    """A data batch whose first three rows end in 9 padding positions (segment 0)."""
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batch = {k: np.array(v) for k, v in data.next_batch().items()}
    data.close()
    for key in ("segment_ids", "tokens", "positions"):
        batch[key][:3, -9:] = 0
    return batch


def _leaves(tree, name) -> list[np.ndarray]:
    """The arrays at paths naming `name`, in path order."""
    found = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return [np.asarray(v) for p, v in found if name in jax.tree_util.keystr(p)]


@pytest.mark.parametrize("scan", ["false", "true"])
def test_selection_bias_steps_by_the_global_batch_counts_as_model_state(scan):
    rate = 0.01
    cfg, b = _built(
        "moe.router=sigmoid_topk",
        f"moe.bias_update_rate={rate}",
        f"moe.initial_bias={INIT}",
        "optim.weight_decay=0.5",  # would move the bias if the optimizer held it
        f"model.scan_layers={scan}",
    )
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(b.state)]
    assert {p.split("[")[0] for p in paths if "selection_bias" in p} == {".model_state"}
    batch = _padded_batch(cfg)
    valid = batch["segment_ids"][:, :-1].reshape(-1) > 0
    assert not valid.all()

    @jax.jit
    def expert_ids(params, model_state):
        """Every MoE layer's chosen experts over the whole batch (both micro-batches)."""
        model = nnx.merge(b.graphdef, params, model_state, b.rest)
        _, aux = model(
            jnp.asarray(batch["tokens"][:, :-1]),
            positions_BS=jnp.asarray(batch["positions"][:, :-1]),
            segment_ids_BS=jnp.asarray(batch["segment_ids"][:, :-1]),
        )
        return aux[IDS_KEY]

    step = program.jit_train_step(b)
    state, bias = b.state, np.float32(INIT)
    for _ in range(2):  # the second step routes with the bias the first one moved
        with b.plan.rules(), capture_expert_ids():
            ids_NTK = np.asarray(expert_ids(state.params, state.model_state))
        # The oracle: counts over the non-padding positions of the global batch, in NumPy.
        counts = np.stack([np_ref.counts(ids, valid, E) for ids in ids_NTK])
        sign = np.sign(counts.mean(-1, keepdims=True) - counts).astype(np.float32)
        want = bias + np.float32(rate) * sign
        with b.plan.rules():
            state, _ = step(state, program.put_batch(batch, b.batch_sharding))
        got = np.concatenate([np.atleast_2d(v) for v in _leaves(state.model_state, "selection")])
        np.testing.assert_array_equal(got, want)
        bias = want
    assert not _leaves(state.opt_state, "selection") and not _leaves(state.params, "selection")


def test_global_batch_loss_reads_the_earlier_micro_batches_loads():
    from moetext.program.step import accumulated_value_and_grad

    cfg, b = _built("moe.aux_loss_scope=global_batch")
    _, b_micro = _built("moe.aux_loss_scope=micro_batch")
    batch = {k: jnp.asarray(v) for k, v in _padded_batch(cfg).items()}
    loss_fn = jax.jit(make_loss_fn(b.graphdef, b.rest))
    params, ms = b.state.params, b.state.model_state
    with b.plan.rules():
        # The unsplit step (grad_accum_steps=1): the micro_batch scope's loss.
        whole = loss_fn(params, batch, ms)[1][1]["load_balance_loss"]
        micro = make_loss_fn(b_micro.graphdef, b_micro.rest)(params, batch)[1][1]
        np.testing.assert_allclose(whole, micro["load_balance_loss"], rtol=1e-6)
        # Micro-batch 1 (rows 1, 3, ...) sees micro-batch 0's counts in the buffer.
        mb = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
        aux0 = loss_fn(params, mb[0], ms)[1][1]
        ms1 = make_accumulate(b.graphdef, b.rest)(params, ms, aux0)
        prior = _leaves(ms1, "load_prior")
        np.testing.assert_array_equal(np.stack(prior).reshape(-1, E), aux0["expert_counts"])
        aux1 = loss_fn(params, mb[1], ms1)[1][1]
        alone = loss_fn(params, mb[1], ms)[1][1]
        assert abs(float(aux1["load_balance_loss"]) - float(alone["load_balance_loss"])) > 1e-4
        accumulate = make_accumulate(b.graphdef, b.rest)
        acc = jax.jit(
            accumulated_value_and_grad(make_loss_fn(b.graphdef, b.rest), 2, accumulate=accumulate)
        )
        (_, (_, aux, _, _)), _ = acc(params, batch, ms)
    want = (aux0["load_balance_loss"] + aux1["load_balance_loss"]) / 2
    np.testing.assert_allclose(aux["load_balance_loss"], want, rtol=1e-6)


def _block(**moe):
    cfg = tiny_moe(num_experts=E, num_experts_per_tok=K, **moe)
    dims = dict(emb_dim=D, init_std=0.3, param_dtype=jnp.float32)
    rngs = nnx.Rngs(params=0)
    router = build_router(cfg, **dims, rngs=rngs)
    return MoEBlock(
        cfg, gmm_from_config(KERNELS), router=router, dtype=jnp.float32, **dims, rngs=rngs
    )


def test_balanced_override_sends_token_t_to_t_k_plus_j_with_equal_weights():
    blk = _block(routing_override="balanced")
    routing = blk._route(_x(), None)
    t = np.arange(B * S)[:, None]
    np.testing.assert_array_equal(np.asarray(routing.ids_TK), (t * K + np.arange(K)) % E)
    np.testing.assert_array_equal(np.asarray(routing.weights_TK), np.full((B * S, K), 1 / K))


def test_random_override_draws_k_distinct_experts_from_a_key_each_step_advances():
    blk = _block(routing_override="random")
    assert "override_key" in nnx.to_pure_dict(nnx.state(blk, nnx.Variable))
    x = _x()
    first = np.asarray(blk._route(x, None).ids_TK)
    assert all(len(set(row)) == K for row in first.tolist()) and first.max() < E
    np.testing.assert_array_equal(np.asarray(blk._route(x, None).ids_TK), first)  # same key
    key0 = np.asarray(blk.override_key[...])
    blk.update_state({"expert_counts": jnp.zeros(E)})
    second = np.asarray(blk._route(x, None).ids_TK)
    assert (second != first).any()
    # The key is ModelState (checkpointed with the train state): the next step's key is a
    # function of it alone, so a restored key continues the same draws.
    want = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key0), 1))
    np.testing.assert_array_equal(np.asarray(blk.override_key[...]), np.asarray(want))


@pytest.mark.parametrize(
    "override,message",
    [
        ("moe.aux_loss_scope=global", r"micro_batch.*sequence.*global_batch"),
        ("moe.routing_override=even", r"none.*balanced.*random"),
        ("moe.n_group=3", r"moe.n_group=3 must divide moe.num_experts=8"),
        ("moe.n_group=8", r"moe.n_group=8 .* at least 2"),
        ("moe.bias_update_rate=-0.1", r"moe.bias_update_rate must be >= 0"),
        ("moe.initial_bias=[0.1,0.2]", r"moe.initial_bias has 2 values for moe.num_experts=8"),
    ],
)
def test_bad_routing_fields_are_one_config_error_naming_them(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        config.load(TINY, [override])
    assert "\n" not in str(err.value)


def test_too_few_eligible_experts_is_a_config_error():
    # 1 group of 2 experts eligible for 4 experts per token.
    over = ["moe.n_group=4", "moe.topk_group=1", "moe.num_experts_per_tok=4"]
    with pytest.raises(ConfigError, match=r"moe.topk_group=1 .* moe.num_experts_per_tok=4"):
        config.load(TINY, over)


def test_resume_refuses_a_new_router_layout_or_scope_and_allows_rates_and_weights():
    saved = to_dict(config.load(TINY, ["moe.router=sigmoid_topk"]))
    for change in ("moe.router=softmax_topk", "moe.n_group=2", "moe.aux_loss_scope=sequence"):
        field = change.split("=")[0]
        cfg = config.load(TINY, ["moe.router=sigmoid_topk", change])
        with pytest.raises(CheckpointError, match=field):
            check_config(saved, cfg, "c")
    cfg = config.load(
        TINY, ["moe.router=sigmoid_topk", "moe.bias_update_rate=0.01", "moe.aux_loss_weight=0.1"]
    )
    allowed = check_config(saved, cfg, "c")
    assert [line.split(":")[0] for line in allowed] == [
        "moe.aux_loss_weight",
        "moe.bias_update_rate",
    ]
