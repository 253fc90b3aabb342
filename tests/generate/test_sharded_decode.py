"""Sharded decoding: greedy generate_ids under the fsdp, fsdp_ep (expert=2) and fsdp_tp
(tensor=2) presets on 4 fake CPU devices gives the one-device tokens and logits.

The model is the dense_first_t5 fixture converted to orbax (3 layers, 4 experts, 4 heads, 2 kv
heads, vocab 96; f32), loaded as `moetext.generate.load` does: params restored onto the plan's
shardings. Each preset decodes twice, with only the params sharded (what `python -m
moetext.generate` runs) and traced under the preset's rules (activation constraints on, the MoE
blocks through the sharded dispatch, all-to-all under fsdp_ep). The device count is fixed when
jax initialises, so it all runs in one fresh interpreter (sharded_worker.py).

Budget: ~45 s on 2 cores (one subprocess: 7 decode compiles).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_devices import run_worker
from moetext.convert.hf_to_orbax import hf_to_orbax

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "dense_first_t5"
PRESETS = ["fsdp", "fsdp_ep", "fsdp_tp"]
MODES = ["params", "rules"]
# float32 end to end. Sharding changes reduction orders (embed-sharded matmuls summed across
# fsdp shards, attention/MLP partial sums across tensor shards, expert rows regrouped per
# shard), so logits agree to f32 rounding, not bitwise. Measured max |sharded - one device|
# over all 8 steps: <= 2.6e-6 (|logits| up to 4.2); bound 1e-5 (~4x the worst seen). The
# reference's smallest top-1/top-2 gap (~9e-3) is far above it, so greedy tokens must match.
ATOL = 1e-5
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("sharded_decode") / "ckpt"
    hf_to_orbax(FIXTURE, ckpt)
    return run_worker("tests.generate.sharded_worker", str(ckpt), timeout_s=TIMEOUT_S, devices=4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_sharded_greedy_decoding_matches_one_device(results, preset, mode):
    r = results[f"{preset}/{mode}"]
    assert "error" not in r, r["error"]
    assert r["tokens"] == results["ref"] and all(len(t) == 8 for t in r["tokens"])
    assert r["logit_diff"] <= ATOL, r["logit_diff"]
    # Under the rules the two MoE layers trace through the sharded dispatch, in the prefill and
    # in the decode step; with only the params sharded they keep the single-shard path.
    assert r["dispatches"] == (4 if mode == "rules" else 0), r


def test_reference_tokens_are_not_a_near_tie(results):
    assert results["margin"] > 100 * ATOL, results["margin"]


def test_presets_really_shard_the_weights(results):
    # w_gate [E=4, D=32, F=24], w_q [D=32, N=4, H=16]: what one of the 4 devices holds.
    want = {
        "fsdp": ({"fsdp": 4}, [4, 8, 24], [8, 4, 16], 1),
        # fsdp_ep: experts over expert, their D over fsdp; w_q's D over fsdp x expert.
        "fsdp_ep": ({"fsdp": 2, "expert": 2}, [2, 16, 24], [8, 4, 16], 2),
        "fsdp_tp": ({"fsdp": 2, "tensor": 2}, [4, 16, 12], [16, 2, 16], 1),
    }
    for preset, (mesh, w_gate, w_q, expert_shards) in want.items():
        r = results[f"{preset}/rules"]
        assert {k: v for k, v in r["mesh"].items() if v > 1} == mesh, r
        assert r["shards"] == {"w_gate": w_gate, "w_q": w_q}, r
        assert r["layout"]["num_shards"] == expert_shards, r
