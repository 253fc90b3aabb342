"""One process of a multi-process training run with a routing trace (see
test_routing_trace.py).

`python -m tests.train.routing_trace_worker coordinator num_processes process_id config
[overrides...]`: joins through jax.distributed (gloo CPU collectives) and runs `train.run` on
the config. Prints `RESULT {"process": i}` when done.
"""

from __future__ import annotations

import json
import sys

import jax

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
import moetext.models  # noqa: F401  (registers the families' config sections)
from moetext import config, train


def main(coordinator: str, num_processes: str, process_id: str, *cfg_args: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, int(num_processes), int(process_id))
    train.run(config.load(cfg_args[0], list(cfg_args[1:])))
    jax.distributed.shutdown()
    print("RESULT " + json.dumps({"process": int(process_id)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
