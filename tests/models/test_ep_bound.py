"""What an EP receive bound drops, offline (`ep_exchange.bound_drops`, scripts/ep_bound.py):
against a per-row re-derivation of the policy, and against what a training run under the bound
reported.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ep_worker import kept_assignments

from fake_devices import worker_env
from moetext.models.moe import ep_exchange

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/ep_bound.py"


def dropped_per_row(ids_TK, num_experts, expert_shards, token_shards, factor):
    """The policy row by row (`ep_worker.kept_assignments`) in each EP group of expert_shards
    consecutive token shards."""
    t, k = ids_TK.shape
    r = ep_exchange.recv_rows(t // token_shards * k, expert_shards, factor)
    groups = ids_TK.reshape(token_shards // expert_shards, -1, k)
    n_local = num_experts // expert_shards
    return sum(int((~kept_assignments(g, expert_shards, n_local, r)).sum()) for g in groups)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 0.0])
@pytest.mark.parametrize(("experts", "p", "shards"), [(8, 4, 8), (16, 2, 4), (8, 8, 8)])
def test_bound_drops_matches_the_row_by_row_policy(factor, experts, p, shards):
    rng = np.random.default_rng(experts * p + shards)
    skew = rng.dirichlet(np.full(experts, 0.5))
    ids = np.stack([rng.choice(experts, 2, replace=False, p=skew) for _ in range(64)])
    dropped, total = ep_exchange.bound_drops(ids, experts, p, shards, factor)
    assert total == ids.size
    assert dropped == dropped_per_row(ids, experts, p, shards, factor)
    if factor == 0.0:
        assert dropped == 0  # the worst-case buffer holds everything


def test_bound_drops_names_what_does_not_split():
    with pytest.raises(ValueError, match=r"6 experts, 8 token shards and 64 tokens.*4 expert"):
        ep_exchange.bound_drops(np.zeros((64, 2), np.int32), 6, 4, 8, 1.0)


def test_script_reproduces_what_the_run_reported(tmp_path):
    # The tiny config on 8 fake devices, fsdp_ep with 4 expert shards, bound 1.25, traced: the
    # script's per-step figure from the trace equals the dropped_fraction the step reported
    # (both from the same counts, the script in NumPy, the step in the exchange).
    run = tmp_path / "run"
    train = [
        sys.executable,
        "-m",
        "train",
        str(REPO / "configs/models/tiny-qwen3-moe.yml"),
        "sharding.preset=fsdp_ep",
        "sharding.mesh.expert=4",
        "moe.ep_buffer_factor=1.25",
        "train.steps=3",
        "train.log_every=1",
        "train.routing_trace=[1,3]",
        f"train.run_dir={run}",
        "train.progress_bar=false",
    ]
    subprocess.run(train, env=worker_env(8), cwd=REPO, check=True, capture_output=True, timeout=600)
    reported = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "dropped_fraction" in row:
            reported[row["step"]] = row
    traced = sorted((run / "routing_trace").glob("step_*.npz"))
    assert len(traced) == 3
    for path in traced:
        step = int(path.stem.split("_")[1])
        one = tmp_path / f"one_{step}"
        one.mkdir()
        (one / path.name).write_bytes(path.read_bytes())
        out = subprocess.run(
            [sys.executable, str(SCRIPT), f"one_{step}", "--num_experts", "8"]
            + ["--expert_shards", "4", "--token_shards", "8", "--bounds", "1.25,0.5"],
            env=worker_env(1),
            cwd=tmp_path,  # a relative trace dir, from another working directory
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        table = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[2:]}
        for key in ("layer_0", "layer_1", "all"):
            metric = "dropped_fraction" + ("" if key == "all" else f"/{key}")
            # Printed to 4 decimals; the counts are exact.
            assert float(table[key][0]) == pytest.approx(reported[step][metric], abs=5e-5)
        # A tighter bound drops more, and the last column names the bound that drops nothing.
        assert float(table["all"][1]) >= float(table["all"][0])
        assert float(table["all"][2]) >= 1.0


def test_script_errors_name_the_problem(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args],
            env=worker_env(1),
            capture_output=True,
            text=True,
        )

    out = run(str(tmp_path), "--num_experts", "8", "--expert_shards", "4", "--token_shards", "8")
    assert out.returncode == 2 and "no step_<n>.npz in" in out.stderr
    np.savez(tmp_path / "step_1.npz", layer_0=np.zeros((2, 6, 2), np.int32))
    out = run(str(tmp_path), "--num_experts", "8", "--expert_shards", "4", "--token_shards", "8")
    assert out.returncode == 2 and "12 tokens must all split" in out.stderr.replace("\n", " ")
    out = run(str(tmp_path), "--num_experts", "8", "--expert_shards", "4", "--token_shards", "4")
    assert out.returncode == 0, out.stderr
    assert "no drops at" in out.stdout
    out = run(
        str(tmp_path),
        "--num_experts",
        "8",
        "--expert_shards",
        "4",
        "--token_shards",
        "4",
        "--bounds",
        "1,0",
    )
    assert out.returncode == 2 and "every bound must be > 0" in out.stderr
