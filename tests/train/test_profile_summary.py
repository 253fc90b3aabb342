"""scripts/profile_summary.py on a real jax.profiler trace: steps counted, operations by kind."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/profile_summary.py"


def _summary(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_profile_summary_counts_steps_and_times_the_step_operations(tmp_path):
    def train_step(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.tanh(a @ b) + 1.0

    def other(a: jax.Array) -> jax.Array:
        return a * 2.0

    step, noise = jax.jit(train_step), jax.jit(other)
    a = jnp.ones((512, 512), jnp.float32)
    step(a, a).block_until_ready()  # compiled before the trace
    noise(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "prof"), create_perfetto_trace=True):
        for _ in range(3):
            out = step(a, a)
            noise(out).block_until_ready()
    out = _summary(str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "steps: 3 (dispatches of PjitFunction(train_step))" in out.stdout
    # The matmul is an operation of its own (a YNNPACK fusion or an Eigen dot) with time on it.
    rows = re.findall(r"^(ynn_fusion|dot\S*)\s+(\d+)\s+([\d.]+)", out.stdout, re.M)
    assert rows and all(float(ms) > 0 for _, _, ms in rows), out.stdout
    missing = _summary(str(tmp_path), "--program", "nothing_like_this")
    assert missing.returncode != 0 and "named nothing_like_this*" in missing.stderr
    nodir = _summary(str(tmp_path / "absent"))
    assert nodir.returncode != 0 and "absent is not a directory" in nodir.stderr
