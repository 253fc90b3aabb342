"""Run Python in a fresh interpreter with N fake CPU devices and read back its JSON result.

jax fixes the device count when it initialises, so multi-device checks run in a subprocess
that prints one line `RESULT <json>`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_result(argv: list[str], *, timeout_s: float, devices: int = 8) -> dict:
    """Runs `python <argv>` on `devices` fake CPU devices; returns its RESULT json."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO / "src"),
    )
    out = subprocess.run(
        [sys.executable, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])
