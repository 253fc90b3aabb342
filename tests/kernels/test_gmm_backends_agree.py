"""Every registered backend (but the oracle) gives the same gmm, dlhs and drhs on the table.

Legend: M rows, K contraction, N outputs, G groups.

Tolerance: each backend is within the shapes.assert_gmm_close bound B of the float64 truth
(f32 inputs: gamma_len * sum|a||b|), so two backends differ by at most 2B; the check uses 2B
around the first backend's result. Backends are discovered with available_backends(), so new
ones (pallas_tpu, tokamax) join automatically. Runs in f32; the jitted runners are shared with
gmm_suite, so backends already compiled by their own module in this session are not recompiled.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from gmm_suite import gmm_vjp
from shapes import GMM_CASES, U_F32, f64, make_inputs

from moetext.kernels.gmm import available_backends, gmm_reference, tgmm_reference

# Backends too slow to run the whole table here. pallas_tpu runs in Pallas interpret mode on
# CPU (an XLA while loop per grid step, seconds of compile per shape); test_pallas_tpu checks
# it against the same float64 oracles on this same shape table.
SLOW_BACKENDS = ("pallas_tpu",)
BACKENDS = [b for b in available_backends() if b != "reference" and b not in SLOW_BACKENDS]


@pytest.mark.skipif(len(BACKENDS) < 2, reason="fewer than two fast backends registered")
@pytest.mark.parametrize("case", GMM_CASES, ids=str)
def test_all_backends_agree(case):
    lhs, rhs, dout, gs = make_inputs(case, jnp.float32, seed=11)
    a, b, d = (np.abs(f64(t)) for t in (lhs, rhs, dout))
    rows = max(case.group_sizes)
    bounds = [  # 2 * gamma_len * sum|a||b| for out, dlhs, drhs
        2 * length * U_F32 / (1 - length * U_F32) * mag
        for length, mag in (
            (case.k, gmm_reference(a, b, gs)),
            (case.n, gmm_reference(d, b, gs, transpose_rhs=True)),
            (rows, tgmm_reference(a, d, gs)),
        )
    ]
    first, *others = BACKENDS
    base = gmm_vjp(first)(lhs, rhs, dout, gs, 0)
    for name in others:
        got = gmm_vjp(name)(lhs, rhs, dout, gs, 0)
        for what, x, y, bound in zip(("out", "dlhs", "drhs"), base, got, bounds, strict=True):
            err = np.abs(f64(x) - f64(y))
            assert (err <= bound).all(), (
                f"{case}/{what}: {first} vs {name} differ by {err.max():.3g} "
                f"(allowed {bound.ravel()[err.argmax()]:.3g} there)"
            )
