"""Run a worker module in a fresh interpreter with N fake CPU devices; read back its JSON result.

jax fixes the device count when it initialises, so multi-device checks run in a subprocess:
`python -m tests.<package>.<module> [args]` from the repository root (tests/ is a namespace
package there), which prints one line `RESULT <json>`. Workers are ordinary modules beside
their tests, linted and type-checked like the rest. `running` is for a process the test drives
while it runs (signals, limits), which must not outlive the test.
"""

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker_env(devices: int) -> dict[str, str]:
    """This environment on `devices` fake CPU devices, outside any distributed run."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        # tests/ too: workers import this module's helpers as `fake_devices`, as tests do.
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]),
    )
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    return env


def run_worker(module: str, *args: str, timeout_s: float, devices: int = 8) -> dict[str, Any]:
    """Runs `python -m module args` on `devices` fake CPU devices; returns its RESULT json."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=worker_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


@contextmanager
def running(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """`Popen(cmd, text=True, **popen)` for the with-block; on leaving it (an assert failed, a
    deadline passed), a process still running is killed, then waited for and its pipes closed."""
    with subprocess.Popen(cmd, text=True, **popen) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


@contextmanager
def split_like_a_3d_slice() -> Iterator[None]:
    """In a worker: moetext.sharding.torus.split_for_collectives splits every mesh axis of 8
    devices into 2 x 4, as it does a weight-gather axis spanning three dims of a TPU torus, and
    a group over several mesh axes needs per-axis collectives (`needs_split_jointly`), as
    fsdp x expert does over a whole 3D slice (fake CPU devices have no torus)."""
    from moetext.sharding import torus

    real = torus._inner_size, torus.needs_split_jointly
    torus._inner_size = lambda lines, slice_size: 4 if len(lines[0]) == 8 else None
    torus.needs_split_jointly = lambda mesh, axes: sum(mesh.shape[a] > 1 for a in axes) > 1
    try:
        yield
    finally:
        torus._inner_size, torus.needs_split_jointly = real
