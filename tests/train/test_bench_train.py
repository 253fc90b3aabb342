"""scripts/bench_train.py's per-arm environment items (`env:VAR=VALUE`), as a user types them."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts/bench_train.py"), "tiny-qwen3-moe.yml", *args],
        cwd=REPO / "configs/models",
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_bench_train_env_items_apply_to_their_arm_and_bad_ones_fail_first():
    """A malformed env item fails before anything compiles; a well-formed one is set while its
    own arm traces: the first arm (none) compiles, then a bad MOETEXT_CPU_GMM_DOTS value in the
    second arm's environment fails that arm's trace with the kernels' own error."""
    malformed = _bench("--arm", "x", "env:MOETEXT_CPU_GMM_DOTS")
    assert malformed.returncode != 0
    assert "'env:MOETEXT_CPU_GMM_DOTS' must be env:VAR=VALUE" in malformed.stderr
    bogus = _bench("--steps", "1", "--warmup", "0", "--arm", "x", "env:MOETEXT_CPU_GMM_DOTS=bogus")
    assert bogus.returncode != 0
    assert "MOETEXT_CPU_GMM_DOTS='bogus': expected native or widen" in bogus.stderr
