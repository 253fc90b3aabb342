"""Two real processes (jax.distributed on 127.0.0.1, gloo) each read only their own rows of the
embedded corpus; together their rows equal the one-process global batch, bit for bit."""

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fake_devices import run_worker
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
    addr = f"127.0.0.1:{_free_port()}"

    def process(i: int) -> dict:
        out = str(tmp_path / f"p{i}.npz")
        args = [addr, "2", str(i), out, str(TINY), *OVERRIDES]
        return run_worker("tests.data.multihost_worker", *args, timeout_s=300, devices=1)

    # Both at once: each blocks in jax.distributed.initialize until the other joins.
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(process, range(2)))

    rows = [r["rows"] for r in results]
    assert rows == [[0, 1], [2, 3]]  # each process owns the rows its one device holds
    shards = [dict(np.load(tmp_path / f"p{i}.npz")) for i in range(2)]
    whole = data_lib.build(cfg.data, cfg.model.vocab_size)
    try:
        for n in range(3):
            want = whole.next_batch()
            for key, array in want.items():
                for r in range(4):
                    np.testing.assert_array_equal(shards[r // 2][f"{n}/{key}/{r}"], array[r])
    finally:
        whole.close()
