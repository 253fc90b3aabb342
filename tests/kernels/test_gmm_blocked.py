"""The "blocked" grouped-matmul backend vs the float64 oracles (shared suite in gmm_suite)."""

import jax.numpy as jnp
import numpy as np
import pytest
from gmm_suite import *  # noqa: F403  (the shared backend tests, collected here)
from shapes import assert_gmm_close


@pytest.fixture
def backend():
    return "blocked"


@pytest.mark.parametrize(
    "m, sizes, tiling",
    [
        (5, (2, 0, 3), None),  # M below the smallest default tile: tiles shrink to M
        (1, (0, 1), None),
        (200, (5, 60, 135), (16, 128, 128)),  # tm=16: many full tiles per group, sizes 16 and 8
    ],
)
def test_blocked_tiny_m_and_tiling_override(m, sizes, tiling):
    from moetext.kernels.gmm import gmm, gmm_reference, tgmm, tgmm_reference
    from moetext.kernels.gmm.blocked import choose_tiles

    if tiling is not None:
        assert choose_tiles(m, len(sizes), tiling) == (16, 8)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), 24, 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((m, 16)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    # The shared tolerance rule (shapes.assert_gmm_close: f32 summation bound, exact zeros).
    got = gmm(x, w, gs, backend="blocked", tiling=tiling)
    a, b, c = (np.asarray(t, np.float64) for t in (x, w, y))
    want, mag = gmm_reference(a, b, sizes), gmm_reference(abs(a), abs(b), sizes)
    assert_gmm_close(got, want, mag, 24, jnp.float32, "gmm")
    got_t = tgmm(x, y, gs, backend="blocked", tiling=tiling)
    want_t, mag_t = tgmm_reference(a, c, sizes), tgmm_reference(abs(a), abs(c), sizes)
    assert_gmm_close(got_t, want_t, mag_t, max(sizes), jnp.float32, "tgmm")
