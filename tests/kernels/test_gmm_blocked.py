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


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("dots", ("native", "widen"))
def test_blocked_both_tile_dot_forms(monkeypatch, dots, dtype):
    # The shared suite runs the form this host picks (kernels/host_dots.widen_gmm_tiles); this
    # runs both on any host: operands as given with a transposed lhs in tgmm (native), and
    # bf16 tiles widened to f32 with tgmm as row contractions (widen). Same f32 products, so
    # the same oracle bound (shapes.assert_gmm_close); a group_offset window covers the masks.
    import jax
    from gmm_suite import _check_gmm
    from shapes import OPTION_CASES, make_inputs

    from moetext.kernels import host_dots
    from moetext.kernels.gmm import gmm

    monkeypatch.setenv(host_dots.GMM_ENV, dots)
    assert host_dots.widen_gmm_tiles() == (dots == "widen")
    case = OPTION_CASES[0]
    lhs, rhs, dout, gs = make_inputs(case, dtype, seed=7)
    offset, num_local = 1, case.g - 1
    local = rhs[offset : offset + num_local]

    def run(a, b, d):  # traced afresh here, under this test's setting
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, gs, backend="blocked", group_offset=offset), a, b)
        return (out, *vjp(d))

    text = str(jax.make_jaxpr(run)(lhs, local, dout))
    # The weight gradient's tile product: a row contraction only in the widened form.
    assert ("dimension_numbers=(([0], [0]), ([], []))" in text) == (dots == "widen")
    res = jax.jit(run)(lhs, local, dout)
    _check_gmm(res, lhs, local, dout, gs, offset, False, dtype, case)
