"""Run in a fresh single process (see test_multihost.py): restores the newest checkpoint of two
run directories onto this process's devices and prints the largest parameter difference."""

from __future__ import annotations

import json
import sys

import jax  # noqa: E402
import numpy as np  # noqa: E402

import moetext  # noqa: F401  (platform defaults before jax)
from moetext import config  # noqa: E402
from moetext.checkpoint import Checkpointer, abstract_like  # noqa: E402
from moetext.train import loop  # noqa: E402


def restore(run_dir: str):
    cfg = config.load(f"{run_dir}/config.yml", [f"train.run_dir={run_dir}"])
    b = loop.build(cfg)
    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    step = ckpt.latest_step()
    state, _, _ = ckpt.restore(step, abstract_like(b.state))
    ckpt.close()
    return step, jax.tree.map(np.asarray, jax.device_get(state.params))


def main(run_a: str, run_b: str) -> None:
    step_a, a = restore(run_a)
    step_b, b = restore(run_b)
    diff = max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))
    scale = max(jax.tree.leaves(jax.tree.map(lambda y: float(np.max(np.abs(y))), b)))
    print(
        "RESULT "
        + json.dumps(
            {
                "steps": [step_a, step_b],
                "max_abs_diff": diff,
                "max_abs": scale,
                "devices": jax.device_count(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
