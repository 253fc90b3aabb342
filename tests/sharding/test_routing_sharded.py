"""The aux-loss-free selection bias under sharding equals the one-device run (8 fake CPU
devices, fsdp and fsdp_ep presets, gradient accumulation, padded rows): the bias update uses
the whole global batch's expert counts, so every replica takes the same step."""

import pytest

from fake_devices import run_worker_once

TIMEOUT_S = 1200  # three 8-device compiles of a 1-layer model; wall time grows with host load


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker_once(tmp_path_factory, "tests.sharding.routing_worker", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_ep"])
def test_sharded_selection_bias_equals_one_device(results, name):
    ref, r = results["single"], results[name]
    assert r["mesh"] != ref["mesh"]
    # Counts are integers and sign() is exact: the same routing gives the same bias bit for bit.
    assert r["biases"] == ref["biases"]
    # The bias moved every step (8 experts never split 16*64*2 assignments evenly).
    assert all(a != b for a, b in zip(ref["biases"], ref["biases"][1:], strict=False))
    # Losses: sharding only reorders f32 reductions (test_equivalence.py bound, 2e-6 relative).
    for a, b in zip(r["step_losses"], ref["step_losses"], strict=True):
        assert abs(a - b) <= 2e-6 * abs(b), (r["step_losses"], ref["step_losses"])
