"""One process of a multi-process data run (see test_data_multihost.py).

`python -m tests.data.multihost_worker coordinator num_processes process_id out.npz config
[overrides...]`. Joins through jax.distributed (gloo CPU collectives), reads only the rows its
devices hold, places three batches as global sharded arrays with the trainer's own helpers, and
saves the shards it holds (key `batch/field/global row` -> row) to out.npz for the test to
reassemble. Prints `RESULT {"rows": [...]}`: the global rows this process read.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import config, program
from moetext import data as data_lib


def main(coordinator: str, num_processes: str, process_id: str, out: str, *cfg_args: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, int(num_processes), int(process_id))
    cfg = config.load(cfg_args[0], list(cfg_args[1:]))
    plan = program.make_plan(cfg)
    b = cfg.data.global_batch_size
    rows = program.local_rows(plan.batch_sharding, b)
    data = data_lib.build(cfg.data, cfg.model.vocab_size, rows)
    saved: dict[str, np.ndarray] = {}
    for n in range(3):
        batch = program.put_batch(data.next_batch(), plan.batch_sharding, rows, b)
        for key, array in batch.items():
            for shard in array.addressable_shards:
                for i, r in enumerate(range(*shard.index[0].indices(b))):
                    saved[f"{n}/{key}/{r}"] = np.asarray(shard.data)[i]
    data.close()
    # allow_pickle by name, so that (for mypy too) **saved holds only array names.
    np.savez(out, allow_pickle=False, **saved)
    jax.distributed.shutdown()
    print("RESULT " + json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
