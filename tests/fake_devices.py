"""Run a worker module in a fresh interpreter with N fake CPU devices; read back its JSON result.

jax fixes the device count when it initialises, so multi-device checks run in a subprocess:
`python -m tests.<package>.<module> [args]` from the repository root (tests/ is a namespace
package there), which prints one line `RESULT <json>`. Workers are ordinary modules beside
their tests, linted and type-checked like the rest. `running` is for a process the test drives
while it runs (signals, limits), which must not outlive the test.
"""

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


DEVICE_COUNT = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None) -> str:
    """This process's XLA_FLAGS (with the suite's codegen level, tests/conftest.py) for a
    subprocess on `devices` fake CPU devices, or on the host's one (None)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT)]
    return " ".join(kept if devices is None else [*kept, f"{DEVICE_COUNT}={devices}"])


def worker_env(devices: int) -> dict[str, str]:
    """This environment on `devices` fake CPU devices, outside any distributed run."""
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(devices),
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


FAILED = "__failed__"  # run_worker_once: the key a failed worker's result holds


def run_worker_once(
    tmp_path_factory: Any, module: str, *args: str, timeout_s: float, devices: int = 8
) -> dict[str, Any]:
    """`run_worker`, once per test session. A module fixture runs once in each pytest-xdist
    worker that gets one of its module's tests, so a multi-minute worker could run twice at
    once on a 2-core host, each at half speed. Under xdist the first to ask runs it and leaves
    its result in the session's shared temp folder; the others wait on a lock and read it. A
    worker that failed leaves its failure there instead: the others fail with it rather than
    run it again, one after another."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_worker(module, *args, timeout_s=timeout_s, devices=devices)
    shared = Path(tmp_path_factory.getbasetemp()).parent / "worker_results"  # this session's
    shared.mkdir(exist_ok=True)
    key = hashlib.sha256(json.dumps([module, args, devices]).encode()).hexdigest()[:12]
    path = shared / f"{module}-{key}.json"
    with open(shared / f"{module}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            result: dict[str, Any] = json.loads(path.read_text())
            if FAILED in result:
                pytest.fail(f"{module} failed in another xdist worker:\n{result[FAILED]}")
            return result
        try:
            result = run_worker(module, *args, timeout_s=timeout_s, devices=devices)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            path.write_text(json.dumps({FAILED: str(e)[-8000:]}))
            raise
        path.write_text(json.dumps(result))
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
