"""Synthetic data determinism and the optimizer's decay mask, schedule and clip."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def test_clip_by_global_norm_matches_the_float64_clip():
    """optim.clip_by_global_norm (a scalar scale, so XLA fuses it) against the float64 clip
    g * c / ||g|| on float32 leaves: within 1e-6 relative (the norm's float32 sums and two
    roundings, a few ulp). A bfloat16 leaf (its squares summed in bfloat16 by optax.tree.norm,
    as in optax's own clip) against optax.clip_by_global_norm: within 2^-7 (each side rounds
    twice to bfloat16, 2^-9 each). Under the norm every leaf comes back bit for bit; a NaN
    norm stays NaN."""
    rng = np.random.default_rng(0)
    g = {
        "w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
        "v": jnp.asarray(rng.standard_normal((7,)), jnp.float32),
    }
    norm64 = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in g.values()))
    for c in (0.5, 3.0):  # norm64 is ~45: both clip
        out, _ = optim.clip_by_global_norm(c).update(g, ())
        for k in g:
            want = np.asarray(g[k], np.float64) * c / norm64
            assert out[k].dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(out[k], np.float64), want, rtol=1e-6)
    mixed = {**g, "v": g["v"].astype(jnp.bfloat16)}
    out, _ = optim.clip_by_global_norm(0.5).update(mixed, ())
    want, _ = optax.clip_by_global_norm(0.5).update(mixed, ())
    for k, rtol in (("w", 1e-6), ("v", 2.0**-7)):
        assert out[k].dtype == mixed[k].dtype
        np.testing.assert_allclose(
            np.asarray(out[k], np.float64), np.asarray(want[k], np.float64), rtol=rtol
        )
    out, _ = optim.clip_by_global_norm(norm64 * 1.01).update(g, ())
    for k in g:
        assert np.array_equal(np.asarray(out[k]), np.asarray(g[k]))
    bad = {**g, "w": g["w"].at[0, 0].set(jnp.nan)}
    out, _ = optim.clip_by_global_norm(1.0).update(bad, ())
    assert bool(jnp.isnan(out["v"]).all())


def test_adamw_state_is_optaxs_so_checkpoints_carry_over():
    """The clip keeps optax.clip_by_global_norm's state: the optimizer state's tree (what an
    orbax checkpoint stores) is the one optax's own chain builds, leaf for leaf."""
    params = {"w": jnp.ones((3, 4)), "scale": jnp.ones((4,))}
    cfg = OptimConfig(learning_rate=0.1, weight_decay=0.5, clip_norm=1.0, warmup_steps=0)
    ours = optim.build(cfg, total_steps=10).init(params)
    theirs = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optim.schedule(cfg, 10), weight_decay=0.5, mask=optim.decay_mask),
    ).init(params)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert [x.shape for x in jax.tree.leaves(ours)] == [x.shape for x in jax.tree.leaves(theirs)]


def test_bench_optim_runs_from_another_directory():
    """scripts/bench_optim.py as a user types it (a relative config path, run from the config's
    directory): it checks that moetext's update and optax's agree after one step, then times
    both and prints their ratio; a bad --reps is a one-line error."""
    repo = Path(__file__).resolve().parents[2]

    def bench(reps: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(repo / "scripts/bench_optim.py"), "tiny-qwen3-moe.yml"]
            + ["--reps", reps],
            cwd=repo / "configs/models",
            capture_output=True,
            text=True,
            timeout=600,
        )

    out = bench("1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "moetext / optax:" in out.stdout
    bad = bench("0")
    assert bad.returncode != 0 and "--reps 0: expected at least 1" in bad.stderr
