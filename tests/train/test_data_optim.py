"""Synthetic data determinism and the optimizer's decay mask and schedule."""

import jax.numpy as jnp
import numpy as np
import pytest

from moetext import optim
from moetext.config import DataConfig, OptimConfig
from moetext.data import SyntheticData


def test_synthetic_batches_are_deterministic_and_split():
    d = SyntheticData(DataConfig(seq_len=32, global_batch_size=4, seed=3), vocab_size=100)
    a, b = d.tokens(7), SyntheticData(d.cfg, 100).tokens(7)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 33) and a.dtype == np.int32
    assert (a >= 0).all() and (a < 100).all()
    assert not np.array_equal(d.tokens(7), d.tokens(8))
    assert not np.array_equal(d.tokens(7), d.tokens(7, split="eval"))
    with pytest.raises(ValueError, match="unknown data split 'test'"):
        d.tokens(0, split="test")
    batch = d.batch(7)  # one document per row: segment 1, positions 0..S
    np.testing.assert_array_equal(batch["tokens"], a)
    assert (batch["segment_ids"] == 1).all()
    np.testing.assert_array_equal(batch["positions"][2], np.arange(33))


def test_synthetic_data_follows_its_chain():
    d = SyntheticData(DataConfig(seq_len=256, global_batch_size=8), vocab_size=64)
    t = d.tokens(0)
    follows = d.successors_VN[t[:, :-1]] == t[:, 1:, None]
    # 90% chain steps (+ noise that lands on a successor by chance): at least 88% in the chain.
    assert follows.any(-1).mean() > 0.88
    assert 0 < d.entropy_floor() < np.log(64)


def test_no_weight_decay_on_vectors():
    params = {"w": jnp.ones((3, 4)), "scale": jnp.ones((4,)), "experts": jnp.ones((2, 3, 4))}
    assert optim.decay_mask(params) == {"w": True, "scale": False, "experts": True}
    cfg = OptimConfig(learning_rate=0.1, weight_decay=0.5, clip_norm=None, warmup_steps=0)
    tx = optim.build(cfg, total_steps=10)
    zero = {k: jnp.zeros_like(v) for k, v in params.items()}
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(updates["scale"]).max()) == 0.0
    assert float(jnp.abs(updates["w"]).max()) > 0.0


def test_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(learning_rate=1.0, warmup_steps=4, min_lr_ratio=0.1)
    s = optim.schedule(cfg, total_steps=20)
    assert float(s(0)) == 0.0 and float(s(2)) == pytest.approx(0.5)
    assert float(s(4)) == pytest.approx(1.0)
    assert float(s(20)) == pytest.approx(0.1)
    assert all(float(s(i)) >= float(s(i + 1)) for i in range(4, 20))
