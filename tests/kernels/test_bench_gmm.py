"""scripts/bench_gmm.py's point selection and time budget, run as a user types it (small D, F)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/bench_gmm.py"
SMALL = ["--backends", "blocked", "--d", "64", "--f", "64", "--dtypes", "float32"]


def _rows(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())["rows"]


def test_quick_keeps_the_small_points_and_a_call_over_budget_is_its_only_sample(tmp_path):
    quick = _rows(tmp_path, "--quick", "--routings", "balanced")
    assert {(r["m"], r["g"]) for r in quick} == {(2048, 8), (2048, 32)}
    assert {r["mode"] for r in quick} == {"fwd", "fwd+bwd"}
    assert all(1 <= r["reps"] <= 3 and r["ratio"] > 0 for r in quick)
    # Explicit --gs wins over --quick's; a budget below one call leaves that call as the sample.
    over = _rows(tmp_path, "--quick", "--gs", "4", "--routings", "dirichlet", "--budget-s", "1e-6")
    assert {(r["m"], r["g"]) for r in over} == {(2048, 4)}
    assert all(r["reps"] == 1 and r["ms"] > 0 and r["dense_ms"] > 0 for r in over)
