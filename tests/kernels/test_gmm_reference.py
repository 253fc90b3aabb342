"""The float64 oracles against independent formulations, and the "reference" backend via the api.

Legend: M rows, K contraction, N outputs, G groups, L local groups.

The oracles are loops over group windows; here they are checked against one-hot masked dense
products (a different algorithm: every row times every weight, then selected), in float64, so
the tolerance is float64 round-off (rtol 1e-12). The "reference" backend then runs the shared
backend suite (gmm_suite) through jax.pure_callback.
"""

import numpy as np
import pytest
from gmm_suite import *  # noqa: F403  (the shared backend tests, collected here)
from shapes import GMM_CASES

from moetext.kernels.gmm import gmm_reference, tgmm_reference


@pytest.fixture
def backend():
    return "reference"


def _one_hot_rows(group_sizes, m: int) -> np.ndarray:
    """[M, G] float: row r belongs to group g (rows past the sum belong to none)."""
    ids = np.repeat(np.arange(len(group_sizes)), group_sizes)
    return (
        np.arange(len(group_sizes))[None, :]
        == np.pad(ids, (0, m - len(ids)), constant_values=-1)[:, None]
    ).astype(np.float64)


@pytest.mark.parametrize("case", GMM_CASES, ids=str)
def test_oracles_match_one_hot_dense(case):
    rng = np.random.default_rng(7)
    x_MK = rng.standard_normal((case.m, case.k))
    w_GKN = rng.standard_normal((case.g, case.k, case.n))
    y_MN = rng.standard_normal((case.m, case.n))
    hot_MG = _one_hot_rows(case.group_sizes, case.m)
    num_local = max(1, case.g // 2)
    for offset in sorted({0, case.g - num_local}):
        local_MG = hot_MG[:, offset : offset + num_local]
        w_LKN = w_GKN[offset : offset + num_local]
        want_MN = np.einsum("ml,mk,lkn->mn", local_MG, x_MK, w_LKN)
        got = gmm_reference(x_MK, w_LKN, case.group_sizes, group_offset=offset)
        np.testing.assert_allclose(got, want_MN, rtol=1e-12, atol=1e-12)
        got_t = gmm_reference(
            x_MK,
            np.swapaxes(w_LKN, 1, 2),
            case.group_sizes,
            transpose_rhs=True,
            group_offset=offset,
        )
        np.testing.assert_allclose(got_t, want_MN, rtol=1e-12, atol=1e-12)
        want_LKN = np.einsum("ml,mk,mn->lkn", local_MG, x_MK, y_MN)
        got_w = tgmm_reference(
            x_MK, y_MN, case.group_sizes, num_groups=num_local, group_offset=offset
        )
        np.testing.assert_allclose(got_w, want_LKN, rtol=1e-12, atol=1e-12)


def test_tgmm_reference_defaults_and_window_past_the_end():
    x = np.ones((6, 2))
    y = np.ones((6, 3))
    assert tgmm_reference(x, y, [2, 0, 4]).shape == (3, 2, 3)
    np.testing.assert_array_equal(tgmm_reference(x, y, [2, 0, 4])[1], 0.0)
    # A window reaching past the last group yields zeros for the missing groups.
    out = tgmm_reference(x, y, [2, 0, 4], num_groups=2, group_offset=2)
    np.testing.assert_array_equal(out[0], 4.0)
    np.testing.assert_array_equal(out[1], 0.0)
