"""The 4-device run of test_grad_accum.py: `python -m tests.train.grad_accum_sharded_worker`.

Runs in a fresh interpreter with 4 fake CPU devices (started by tests/fake_devices.py). The
tiny config (1 layer, f32, MoE aux losses off) under the fsdp preset (fsdp = 4) takes one real
train step (program.jit_train_step, traced under the plan's rules as in training) with
train.grad_accum_steps = 1 and 2 from the same state and batch: 8 rows, so each micro-batch
puts one row on each device, and the gradient accumulator is pinned to the params' shardings.
Prints one JSON line: the metrics' relative errors and the largest param difference in units
of the learning rate.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

from moetext import config, program
from moetext import data as data_lib

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
BASE = [
    "data.kind=synthetic",
    "data.seq_len=16",
    "checkpoint.enabled=false",
    "model.num_layers=1",
    "moe.aux_loss_weight=0.0",
    "optim.warmup_steps=0",
    "optim.eps=1e-3",  # Adam's update Lipschitz in g (test_grad_accum.py says why)
    "sharding.preset=fsdp",
]


def one_step(b: program.Built, batch: Any) -> tuple[Any, dict[str, float]]:
    state = jax.tree.map(jnp.copy, b.state)  # the step donates its input state
    step = program.lower_checked(b, program.jit_train_step(b), state, batch).compile()
    state, metrics = step(state, batch)
    m = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    return jax.device_get(state.params), m


def main() -> None:
    cfg = config.load(TINY, BASE)
    b1 = program.build(cfg, jax.devices())
    accum = dataclasses.replace(cfg.train, grad_accum_steps=2)
    b2 = dataclasses.replace(b1, cfg=cfg.replace(train=accum))
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batch = program.put_batch(data.next_batch(), b1.batch_sharding)
    data.close()
    p1, m1 = one_step(b1, batch)
    p2, m2 = one_step(b2, batch)
    diff = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), p2, p1)
    result = {
        "mesh": dict(b1.mesh.shape),
        **{f"{k}_rel": abs(m2[k] / m1[k] - 1) for k in ("loss", "ce_loss", "grad_norm")},
        "param_diff_lr": max(jax.tree.leaves(diff)) / m1["lr"],
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
