"""The "blocked" grouped-matmul backend vs the float64 oracles (shared suite in gmm_suite)."""

import pytest
from gmm_suite import *  # noqa: F403  (the shared backend tests, collected here)


@pytest.fixture
def backend():
    return "blocked"
