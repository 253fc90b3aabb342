"""Two processes on 127.0.0.1 train the tiny config (on text) through the real CLI and match one
process.

Each process owns 2 fake CPU devices (4 in all) and joins through jax.distributed (gloo CPU
collectives); the reference is one process with 4 devices and the same mesh. The 2-process
checkpoint then restores in a single process and equals the reference's parameters.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

from fake_devices import run_worker, worker_env

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
TIMEOUT_S = 900  # generous: 3 processes compile at once on a shared 2-core box
STEPS = 4
COMMON = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.progress_bar=false",
    "train.peak_tflops=1.0",
    "train.eval_every=0",
    f"checkpoint.every={STEPS}",
    "checkpoint.async_save=false",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(run_dir, extra, devices):
    cmd = [
        sys.executable,
        str(REPO / "src/train.py"),
        str(TINY),
        *COMMON,
        f"train.run_dir={run_dir}",
        *extra,
    ]
    return subprocess.Popen(
        cmd,
        env=worker_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )


def _wait(procs) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outs


def _losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_two_processes_match_one_and_checkpoint_restores_in_one(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    addr = f"127.0.0.1:{_free_port()}"
    dist = [f"distributed.coordinator_address={addr}", "distributed.num_processes=2"]
    procs = [_cli(multi, [*dist, f"distributed.process_id={i}"], devices=2) for i in range(2)]
    procs.append(_cli(single, [], devices=4))
    outs = _wait(procs)
    assert "on 4 cpu device(s)" in outs[0], outs[0][-2000:]

    # Each process saved the stream positions of its own rows (the tiny config reads text).
    data_dir = multi / f"checkpoints/{STEPS}/data"
    saved = [json.loads((data_dir / f"process_{i}-of-2.json").read_text()) for i in range(2)]
    assert [sorted(s["rows"]) for s in saved] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]

    a, b = _losses(multi), _losses(single)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    # Same mesh (fsdp=4), same program; only the cross-process (gloo) reductions may sum in a
    # different order: f32 losses agree to a few ulps. Measured: max relative difference 0.
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-6 * abs(b[s]), (s, a[s], b[s])

    r = run_worker(
        "tests.sharding.restore_worker", str(multi), str(single), timeout_s=TIMEOUT_S, devices=1
    )
    assert r["steps"] == [STEPS, STEPS] and r["devices"] == 1
    # Restored onto one device from a 4-shard checkpoint written by two processes: the params
    # equal the single-process run's to f32 rounding of differently ordered reductions.
    assert r["max_abs_diff"] <= 1e-6 * r["max_abs"], r
