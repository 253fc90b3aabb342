"""The single-process restore of test_multihost.py: `python -m tests.sharding.restore_worker A B`.

Restores the newest checkpoint of run directories A and B onto this process's devices and prints
`RESULT <json>`: both steps, the largest parameter difference, the largest parameter of B, and
the device count.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import numpy as np

from moetext import config, program
from moetext.checkpoint import Checkpointer, abstract_like


def restore(run_dir: str) -> tuple[int, Any]:
    """(step, params as NumPy arrays) of the newest checkpoint in run_dir."""
    cfg = config.load(f"{run_dir}/config.yml", [f"train.run_dir={run_dir}"])
    b = program.build(cfg)
    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    step = ckpt.latest_step()
    if step is None:
        raise SystemExit(f"no checkpoint in {run_dir}")
    state, _, _ = ckpt.restore(step, abstract_like(b.state))
    ckpt.close()
    return step, jax.tree.map(np.asarray, jax.device_get(state.params))


def main(run_a: str, run_b: str) -> None:
    step_a, a = restore(run_a)
    step_b, b = restore(run_b)
    diff = max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))
    scale = max(jax.tree.leaves(jax.tree.map(lambda y: float(np.max(np.abs(y))), b)))
    result = {
        "steps": [step_a, step_b],
        "max_abs_diff": diff,
        "max_abs": scale,
        "devices": jax.device_count(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
