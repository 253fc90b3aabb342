"""train.grad_accum_steps: N micro-batches in a scan inside the step equal the unsplit step.

tiny-qwen3-moe computes in float32, so the split and unsplit steps run the same f32 products and
differ only in summation order (the gradient summed over N micro-batches instead of over the
batch at once, the NLL summed per micro-batch first). Tolerances are stated per test, each a few
times what was measured, as in tests/train/test_loss.py.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_devices import run_worker
from moetext import config, program, train
from moetext.config import ConfigError
from moetext.data.batch import from_tokens, target_mask
from moetext.program.step import (
    accumulated_value_and_grad,
    make_eval_step,
    make_loss_fn,
    split_micro_batches,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
QUIET = ["train.progress_bar=false", "train.peak_tflops=1.0", "checkpoint.enabled=false"]
NO_AUX = ["moe.aux_loss_weight=0.0", "moe.z_loss_weight=0.0"]
B, S = 8, 16


def _tiny(extra):
    # warmup_steps=0: the first step already moves the params (lr(0) = peak).
    return config.load(
        TINY,
        [*QUIET, "data.kind=synthetic", f"data.seq_len={S}", "optim.warmup_steps=0", *extra],
    )


def _batch(padded: bool):
    tokens = np.random.default_rng(0).integers(0, 512, (B, S + 1)).astype(np.int32)
    batch = from_tokens(tokens)
    if padded:
        # With 4 micro-batches (rows j and 4 + j): padding and document boundaries only in
        # some rows, so the micro-batches count 15, 31, 32 and 22 targets (of 32 each).
        batch["segment_ids"][0, 6:] = 0
        batch["segment_ids"][4, 11:] = 0
        batch["segment_ids"][1, 5:] = 2
        batch["segment_ids"][3, 8:] = 2
        batch["segment_ids"][7, 8:] = 0
        batch["positions"][1, 5:] = np.arange(S + 1 - 5)
    return batch


def _rel_err(a, b) -> float:
    """Largest over leaves of max|a - b| / max|b|."""
    errs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)), a, b
    )
    return max(jax.tree.leaves(errs))


def _max_abs_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def _one_step(b, batch):
    state = jax.tree.map(jnp.copy, b.state)  # the step donates its input state
    state, metrics = program.jit_train_step(b)(state, program.put_batch(batch, b.batch_sharding))
    return jax.device_get(state.params), jax.device_get(metrics)


def test_four_micro_batches_equal_the_unsplit_step():
    # Adam's update m / (sqrt(v) + eps) is ill-conditioned where |g| ~ eps: with the default
    # 1e-8 an entry whose gradient is rounding noise (1e-5 of its tensor's largest) moves by
    # up to 5e-3 lr between the two summation orders (measured). eps = 1e-3 makes the update
    # Lipschitz in g, so the params test the accumulation (tests/sharding/equivalence_worker.py
    # does the same).
    extra = [*NO_AUX, "optim.eps=1e-3"]
    b1 = program.build(_tiny(extra), jax.devices()[:1])
    b4 = dataclasses.replace(b1, cfg=_tiny([*extra, "train.grad_accum_steps=4"]))
    batch = _batch(padded=False)
    p0 = jax.device_get(b1.state.params)
    p1, m1 = _one_step(b1, batch)
    p4, m4 = _one_step(b4, batch)
    # Measured: loss and ce 1.2e-7 relative, grad_norm equal. Bound: 2e-6 (test_loss.py's).
    for key in ("loss", "ce_loss", "grad_norm"):
        assert m4[key] == pytest.approx(m1[key], rel=2e-6), key
    lr = float(m1["lr"])
    assert float(m4["lr"]) == lr > 0
    # The params after the update (lr = 3e-3; the largest update is ~lr). Measured: they differ
    # by at most 2.0e-5 lr (6e-8, half an f32 ulp of a norm scale of 1.0). Bound: 1e-4 lr; a
    # wrong micro-batch split moves params by O(lr).
    diff, largest = _max_abs_diff(p4, p1), _max_abs_diff(p1, p0)
    assert largest == pytest.approx(lr, rel=0.05)
    assert diff <= 1e-4 * lr, (diff, lr)


def test_micro_batches_with_uneven_target_counts_give_the_batch_ce_and_grads():
    # Each micro-batch's NLL is divided by the whole batch's target count C: the mean of the
    # micro-batches' own CEs would weigh a padded micro-batch's targets up.
    cfg = _tiny(NO_AUX)
    b = program.build(cfg, jax.devices()[:1])
    batch = _batch(padded=True)
    counts = np.asarray(split_micro_batches(target_mask(batch), 4)).sum(axis=(1, 2))
    assert counts.tolist() == [15, 31, 32, 22]
    loss_fn = make_loss_fn(b.graphdef, b.rest)
    plain = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    split = jax.jit(accumulated_value_and_grad(loss_fn, 4))
    (l1, (ce1, _, nll1, c1)), g1 = plain(b.state.params, batch)
    (l4, (ce4, _, nll4, c4)), g4 = split(b.state.params, batch)
    assert float(c4) == float(c1) == counts.sum()
    # Measured: ce and loss 1.5e-7 relative, nll_sum 9.7e-8, the gradients 7.6e-7 of each
    # one's largest entry. Bounds: 2e-6 and 1e-5 (the fused-vs-logits bounds of test_loss.py:
    # the same kind of reordering).
    assert float(ce4) == pytest.approx(float(ce1), rel=2e-6)
    assert float(nll4) == pytest.approx(float(nll1), rel=2e-6)
    assert float(l4) == pytest.approx(float(l1), rel=2e-6)
    assert _rel_err(g4, g1) <= 1e-5


def test_eval_in_micro_batches_equals_the_unsplit_eval():
    # Eval splits the batch like the train step (so it fits where a train micro-batch does):
    # the NLL sum and target count are the whole batch's, moe_loss the micro-batches' mean.
    cfg = _tiny(["moe.z_loss_weight=0.001"])
    b = program.build(cfg, jax.devices()[:1])
    batch = _batch(padded=True)
    one = jax.device_get(jax.jit(make_eval_step(b.graphdef, b.rest))(b.state.params, batch))
    four = jax.device_get(jax.jit(make_eval_step(b.graphdef, b.rest, 4))(b.state.params, batch))
    assert float(four["eval_tokens"]) == float(one["eval_tokens"]) == 100
    # Same products, NLL summed per micro-batch first: the bound of the train-step test above.
    for key in ("eval_nll_sum", "eval_ce_loss"):
        assert float(four[key]) == pytest.approx(float(one[key]), rel=2e-6), key
    micro = {k: split_micro_batches(v, 4) for k, v in batch.items()}
    loss_fn = jax.jit(make_loss_fn(b.graphdef, b.rest))
    each = [loss_fn(b.state.params, {k: v[i] for k, v in micro.items()}) for i in range(4)]
    moe = np.mean([float(aux["moe_loss"]) for _, (_, aux, _, _) in each])
    assert float(four["eval_loss"]) == pytest.approx(float(four["eval_ce_loss"]) + moe, rel=1e-6)


def test_moe_aux_losses_are_averaged_over_micro_batches():
    # With the aux loss weights on, only the aux term differs from the unsplit step: it is the
    # mean of the micro-batches' own aux losses (routing statistics of the tokens seen together).
    cfg = _tiny(["moe.z_loss_weight=0.001"])
    b = program.build(cfg, jax.devices()[:1])
    batch = _batch(padded=True)
    loss_fn = make_loss_fn(b.graphdef, b.rest)
    (l1, (ce1, aux1, _, _)), _ = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        b.state.params, batch
    )
    (l4, (ce4, aux4, _, _)), g4 = jax.jit(accumulated_value_and_grad(loss_fn, 4))(
        b.state.params, batch
    )
    micro = {k: split_micro_batches(v, 4) for k, v in batch.items()}
    each = [jax.jit(loss_fn)(b.state.params, {k: v[i] for k, v in micro.items()}) for i in range(4)]
    for key in ("moe_loss", "load_balance_loss", "router_z_loss", "expert_load"):
        mean = np.mean([np.asarray(aux[key]) for _, (_, aux, _, _) in each], axis=0)
        np.testing.assert_allclose(aux4[key], mean, rtol=2e-6, err_msg=key)
    assert float(aux4["moe_loss"]) > 0 and float(aux4["moe_loss"]) != float(aux1["moe_loss"])
    assert float(ce4) == pytest.approx(float(ce1), rel=2e-6)
    assert float(l4) == pytest.approx(float(ce4 + aux4["moe_loss"]), rel=1e-6)
    assert float(l1) == pytest.approx(float(ce1 + aux1["moe_loss"]), rel=1e-6)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(g4))


def test_sharded_micro_batches_equal_the_unsplit_step():
    # fsdp over 4 fake devices (grad_accum_sharded_worker.py): micro-batches and the
    # accumulator pinned to the batch's and the params' shardings, traced under the rules.
    r = run_worker("tests.train.grad_accum_sharded_worker", timeout_s=900, devices=4)
    assert r["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    # Measured: loss and ce 7.6e-8 relative, grad_norm equal, params 3.4e-6 lr apart.
    # Bounds as in test_four_micro_batches_equal_the_unsplit_step.
    for key in ("loss_rel", "ce_loss_rel", "grad_norm_rel"):
        assert r[key] <= 2e-6, (key, r)
    assert r["param_diff_lr"] <= 1e-4, r


def test_bad_grad_accum_steps_are_config_errors():
    with pytest.raises(ConfigError, match="train.grad_accum_steps must be positive, got 0"):
        config.load(TINY, ["train.grad_accum_steps=0"])
    with pytest.raises(
        ConfigError,
        match="data.global_batch_size=6 is not divisible by train.grad_accum_steps=4",
    ):
        config.load(TINY, ["data.global_batch_size=6", "train.grad_accum_steps=4"])
    # 8 rows in 4 micro-batches of 2: each is split over the devices like the batch.
    cfg = config.load(TINY, ["data.global_batch_size=8", "train.grad_accum_steps=4"])
    config.validate_for_devices(cfg, 2)
    with pytest.raises(ConfigError, match=r"grad_accum_steps=4 micro-batches gives 2 rows each"):
        config.validate_for_devices(cfg, 4)


def test_skip_nonfinite_steps_still_skip_with_micro_batches():
    cfg = _tiny(["train.grad_accum_steps=2", "train.skip_nonfinite_steps=1"])
    b = program.build(cfg, jax.devices()[:1])
    leaves, treedef = jax.tree.flatten(b.state.params)
    leaves[0] = jnp.full_like(leaves[0], jnp.nan)  # every token's loss becomes NaN
    poisoned = dataclasses.replace(b.state, params=jax.tree.unflatten(treedef, leaves))
    kept = jax.device_get(poisoned.params)
    state, m = program.jit_train_step(b)(
        poisoned, program.put_batch(_batch(False), b.batch_sharding)
    )
    assert int(m["skipped"]) == 1 and int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), kept)


def test_trainer_runs_with_grad_accum_steps(tmp_path):
    cfg = _tiny(["train.grad_accum_steps=2", "train.steps=2", "train.log_every=1"])
    train.run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path))))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2]
    assert all(np.isfinite(r[k]) for r in logged for k in ("loss", "ce_loss", "grad_norm"))
    assert config.load(tmp_path / "config.yml").train.grad_accum_steps == 2
