"""Every preset's sharded train step equals the one-device step (8 fake CPU devices).

The device count is fixed when jax initialises, so the work runs in a fresh interpreter
(equivalence_worker.py) with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import pytest

from fake_devices import run_worker_once

TIMEOUT_S = 1500  # ~80 s of CPU; wall time grows with the host's load


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker_once(
        tmp_path_factory, "tests.sharding.equivalence_worker", timeout_s=TIMEOUT_S
    )


def test_meshes_are_what_the_settings_ask(results):
    assert results["single"]["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert results["fsdp"]["mesh"] == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    # dcn_mesh.data=2 with tensor=2 on 8 devices: 2 "slices" of fsdp=2 x tensor=2.
    assert results["fsdp_tp"]["mesh"] == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert results["fsdp_ep"]["mesh"] == {"data": 1, "fsdp": 2, "expert": 4, "tensor": 1}


@pytest.mark.parametrize(
    "name",
    [
        "fsdp",
        "fsdp_tp",
        "fsdp_ep",
        "fsdp_tiled",
        "fsdp_tp_tiled",
        "fsdp_split",
        "fsdp_tp1_split",
        "fsdp_ep_split",
    ],
)
def test_sharded_step_matches_single_device(results, name):
    # *_tiled: the expert-weight gradients reduce-scattered in 4 tiles (equivalence_worker.TILED).
    # *_split: the fsdp axis split 2 x 4 as on a 3D TPU slice, fsdp_ep's fsdp x expert dense
    # weights gathered per axis (equivalence_worker.SPLIT).
    r = results[name]
    # The tiny config computes in f32; sharding only changes the order of reductions (partial
    # sums per device, then across devices), so results agree to f32 rounding. Measured on
    # 8 CPU devices (1 layer): loss <= 8e-8 relative, gradients <= 1.2e-6 of each tensor's
    # largest entry, step losses <= 3e-7 relative. Bounds: ~10x those.
    assert r["loss_rel"] <= 1e-6, r["loss_rel"]
    assert r["grad_rel"] <= 1e-5, r["grad_rel"]
    # Three real train steps (AdamW): losses track the one-device run.
    ref = results["single"]["step_losses"]
    for a, b in zip(r["step_losses"], ref, strict=True):
        assert abs(a - b) <= 2e-6 * abs(b), (r["step_losses"], ref)
    # Params after the steps. The worker runs Adam with eps = 1e-3 (equivalence_worker.BASE):
    # with 1e-8, entries whose gradient is ~eps turn rounding into a sizeable fraction of the
    # learning rate (an embedding row moved 1.2e-4 of max|embed|). Measured with 1e-3:
    # <= 1.1e-7 per tensor (max|diff| / max|ref|); a wrong sharding moves params by O(lr) =
    # O(1e-4) and fails 1e-6 (~10x the measured rounding).
    assert r["param_rel"] <= 1e-6, r["param_rel"]


def test_param_specs_follow_each_preset(results):
    fsdp, tp, ep = (results[n]["specs"] for n in ("fsdp", "fsdp_tp", "fsdp_ep"))
    assert fsdp["w_q"] == ["fsdp", None, None]
    assert fsdp["experts.w_gate"] == [None, "fsdp", None]
    assert tp["w_q"] == ["fsdp", "tensor", None]
    assert tp["w_k"] == ["fsdp", "tensor", None]
    assert tp["lm_head"] == ["tensor", "fsdp"]
    assert tp["experts.w_down"] == [None, "tensor", "fsdp"]
    assert tp["embed"] == ["tensor", "fsdp"]
    assert ep["experts.w_gate"] == ["expert", "fsdp", None]
    assert ep["experts.w_down"] == ["expert", None, "fsdp"]
    assert ep["embed"] == [None, ["fsdp", "expert"]]  # no expert dim: over every chip


def test_split_dense_gathers_reduce_scatter_each_dense_gradient_per_sub_axis(results):
    # fsdp_split (fsdp = 2 x 4, sharding.split_dense_gathers): the 1-layer tiny model's six
    # dense weights (w_q, w_k, w_v, w_o, router, LM head) are multiplied in shard_maps that
    # gather them one sub-axis at a time, so each gradient is two reduce-scatters where GSPMD's
    # fsdp step has at most one; the values match one device
    # (test_sharded_step_matches_single_device).
    # fsdp_ep_split: the same six over fsdp, then expert (2 x 4), against plain fsdp_ep.
    plain_of = {"fsdp_split": "fsdp", "fsdp_tp1_split": "fsdp", "fsdp_ep_split": "fsdp_ep"}
    for name, of in plain_of.items():
        plain, split = results[of]["collectives"], results[name]["collectives"]
        assert split["reduce-scatter"] >= plain["reduce-scatter"] + 2 * 6, (name, split, plain)
        assert split["all-gather"] > plain["all-gather"], (name, split, plain)
