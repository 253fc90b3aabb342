"""Backend-generic gmm/tgmm tests against the float64 oracles; a backend's module runs them.

Legend: M rows, K contraction, N outputs, G groups, L local groups (group_offset window).

Usage in tests/kernels/test_gmm_<name>.py:

    @pytest.fixture
    def backend():
        return "<name>"

    from gmm_suite import *  # noqa: F403  (pytest collects the imported tests in that module)

Everything goes through the public moetext.kernels.gmm.gmm / tgmm under jit, and gradients
through jax.vjp, so the api's custom_vjp and input plumbing are exercised for each backend.
Tolerances: shapes.assert_gmm_close (f32 summation bound + output rounding; reasons there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shapes import DTYPES, GMM_CASES, OPTION_CASES, assert_gmm_close, f64, make_inputs

from moetext.kernels.gmm import gmm, gmm_reference, tgmm, tgmm_reference

__all__ = [
    "test_gmm_forward_and_grads",
    "test_gmm_transpose_rhs",
    "test_gmm_group_offset_windows",
    "test_gmm_existing_out",
    "test_tgmm_forward_and_grads",
]


def _windows(g: int) -> list[tuple[int, int]]:
    """(group_offset, L) for the first, a middle and the last expert shard of G groups."""
    num_local = max(1, g // 2)
    return sorted({(0, num_local), ((g - num_local) // 2, num_local), (g - num_local, num_local)})


@functools.cache  # one jitted runner per (backend, layout): later modules reuse its compiles
def gmm_vjp(backend, transpose_rhs=False):
    """jit(lhs, rhs, dout, group_sizes, group_offset) -> (out, dlhs, drhs) via jax.vjp."""

    @jax.jit
    def run(lhs, rhs, dout, gs, offset):
        def f(a, b):
            return gmm(a, b, gs, backend=backend, transpose_rhs=transpose_rhs, group_offset=offset)

        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(dout))

    return run


def _check_gmm(results, lhs, rhs, dout, gs, offset, transpose_rhs, dtype, case):
    out, dlhs, drhs = results
    a, b, d = f64(lhs), f64(rhs), f64(dout)
    kw = dict(group_offset=offset)
    gk = dict(num_groups=rhs.shape[0], group_offset=offset)
    rows = max(case.group_sizes)
    # Forward contracts K; dlhs contracts N; drhs contracts the rows of one group.
    for what, fn, x, y, extra, length, actual in (
        ("out", gmm_reference, a, b, dict(transpose_rhs=transpose_rhs, **kw), case.k, out),
        ("dlhs", gmm_reference, d, b, dict(transpose_rhs=not transpose_rhs, **kw), case.n, dlhs),
        ("drhs", tgmm_reference, *((d, a) if transpose_rhs else (a, d)), gk, rows, drhs),
    ):
        want = fn(x, y, gs, **extra)
        mag = fn(np.abs(x), np.abs(y), gs, **extra)
        assert_gmm_close(actual, want, mag, length, dtype, f"{case}/{what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", GMM_CASES, ids=str)
def test_gmm_forward_and_grads(backend, case, dtype):
    lhs, rhs, dout, gs = make_inputs(case, dtype)
    res = gmm_vjp(backend)(lhs, rhs, dout, gs, 0)
    _check_gmm(res, lhs, rhs, dout, gs, 0, False, dtype, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_gmm_transpose_rhs(backend, case, dtype):
    lhs, rhs, dout, gs = make_inputs(case, dtype, seed=1, transpose_rhs=True)
    res = gmm_vjp(backend, transpose_rhs=True)(lhs, rhs, dout, gs, 0)
    _check_gmm(res, lhs, rhs, dout, gs, 0, True, dtype, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_gmm_group_offset_windows(backend, case, dtype):
    lhs, rhs, dout, gs = make_inputs(case, dtype, seed=2)
    run = gmm_vjp(backend)  # one compile per L: the offset is traced
    for offset, num_local in _windows(case.g):
        local = rhs[offset : offset + num_local]
        res = run(lhs, local, dout, gs, jnp.int32(offset))
        _check_gmm(res, lhs, local, dout, gs, offset, False, dtype, case)


@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_gmm_existing_out(backend, case):
    lhs, rhs, dout, gs = make_inputs(case, jnp.float32, seed=3)
    offset, num_local = _windows(case.g)[-1]
    local = rhs[offset : offset + num_local]
    prev = jnp.asarray(np.random.default_rng(4).standard_normal((case.m, case.n)), jnp.float32)

    def f(a, b, e):
        return gmm(a, b, gs, backend=backend, group_offset=offset, existing_out=e)

    out, vjp = jax.vjp(f, lhs, local, prev)
    _, _, dprev = vjp(dout)
    mine = (
        gmm_reference(np.ones_like(f64(lhs)), np.ones_like(f64(local)), gs, group_offset=offset)[
            :, :1
        ]
        != 0
    )  # [M, 1] rows of local groups
    want = np.where(mine, gmm_reference(f64(lhs), f64(local), gs, group_offset=offset), f64(prev))
    mag = np.where(
        mine, gmm_reference(np.abs(f64(lhs)), np.abs(f64(local)), gs, group_offset=offset), 0.0
    )
    assert_gmm_close(out, want, mag, case.k, jnp.float32, f"{case}/existing_out")
    # existing_out passes straight through on the other rows, so its cotangent is dout there.
    np.testing.assert_array_equal(f64(dprev), np.where(mine, 0.0, f64(dout)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", OPTION_CASES, ids=str)
def test_tgmm_forward_and_grads(backend, case, dtype):
    lhs, _, rhs_mn, gs = make_inputs(case, dtype, seed=5)
    offset, num_local = _windows(case.g)[-1]
    dout = jnp.asarray(np.random.default_rng(6).standard_normal((num_local, case.k, case.n)), dtype)

    @jax.jit
    def run(a, b, d):
        def f(a, b):
            return tgmm(a, b, gs, num_groups=num_local, group_offset=offset, backend=backend)

        out, vjp = jax.vjp(f, a, b)
        return (out, *vjp(d))

    out, dlhs, drhs = run(lhs, rhs_mn, dout)
    a, b, d = f64(lhs), f64(rhs_mn), f64(dout)
    kw = dict(group_offset=offset)
    tk = dict(num_groups=num_local, **kw)
    for what, fn, x, y, extra, length, actual in (
        ("tgmm", tgmm_reference, a, b, tk, max(case.group_sizes), out),
        ("tgmm_dlhs", gmm_reference, b, d, dict(transpose_rhs=True, **kw), case.n, dlhs),
        ("tgmm_drhs", gmm_reference, a, d, kw, case.k, drhs),
    ):
        want = fn(x, y, gs, **extra)
        mag = fn(np.abs(x), np.abs(y), gs, **extra)
        assert_gmm_close(actual, want, mag, length, dtype, f"{case}/{what}")
