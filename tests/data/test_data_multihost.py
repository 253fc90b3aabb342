"""Two real processes (jax.distributed on 127.0.0.1, gloo) each read only their own rows of the
embedded corpus; together their rows equal the one-process global batch, bit for bit."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from moetext import config
from moetext import data as data_lib

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
OVERRIDES = ["data.kind=tfds", "data.name=python_docs", "data.global_batch_size=4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_disjoint_rows_that_make_the_global_batch(tmp_path):
    cfg = config.load(TINY, OVERRIDES)
    data_lib.resolve_tfds(cfg.data, cfg.model.vocab_size)  # prepare once, before the workers
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO / "src"),
    }
    addr = f"127.0.0.1:{_free_port()}"
    worker = str(Path(__file__).with_name("multihost_worker.py"))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                worker,
                addr,
                "2",
                str(i),
                str(tmp_path / f"p{i}.npz"),
                str(TINY),
                *OVERRIDES,
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]

    shards = [dict(np.load(tmp_path / f"p{i}.npz")) for i in range(2)]
    rows = [list(s.pop("rows")) for s in shards]
    assert rows == [[0, 1], [2, 3]]  # each process owns the rows its one device holds
    whole = data_lib.build(cfg.data, cfg.model.vocab_size)
    try:
        for n in range(3):
            want = whole.next_batch()
            for key, array in want.items():
                for r in range(4):
                    np.testing.assert_array_equal(shards[r // 2][f"{n}/{key}/{r}"], array[r])
    finally:
        whole.close()
