"""The 8-device run of test_routing_sharded.py: `python -m tests.sharding.routing_worker`.

Runs in a fresh interpreter with 8 fake CPU devices (started by tests/fake_devices.py).

Trains the tiny config (1 MoE layer, sigmoid_topk with the aux-loss-free bias moving, gradient
accumulation over 2 micro-batches, padded rows) for three steps on one device and under the
fsdp and fsdp_ep presets; prints one JSON line: per setting the mesh, the step losses and the
selection bias after each step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import numpy as np

from moetext import config, program
from moetext import data as data_lib

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
BASE = [
    "optim.eps=1e-3",  # as equivalence_worker.BASE: rounding-level gradient noise stays small
    "data.kind=synthetic",
    "data.global_batch_size=16",  # 2 micro-batches of 8 rows: one per device
    "train.grad_accum_steps=2",
    "checkpoint.enabled=false",
    "train.progress_bar=false",
    "model.num_layers=1",
    "moe.router=sigmoid_topk",
    "moe.bias_update_rate=0.01",
    "moe.aux_loss_weight=0.0",
]
SETTINGS = {
    "single": ["sharding.preset=fsdp", "sharding.mesh.fsdp=1"],
    "fsdp": ["sharding.preset=fsdp"],
    "fsdp_ep": ["sharding.preset=fsdp_ep", "sharding.mesh.expert=4"],
}
STEPS = 3


def batches(cfg: Any) -> list[dict[str, np.ndarray]]:
    """STEPS data batches, rows 0, 5, 10 ending in 7 padding positions (segment 0)."""
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    out = []
    for _ in range(STEPS):
        batch = {k: np.array(v) for k, v in data.next_batch().items()}
        for key in ("segment_ids", "tokens", "positions"):
            batch[key][::5, -7:] = 0
        out.append(batch)
    data.close()
    return out


def run_setting(name: str, overrides: list[str]) -> dict[str, Any]:
    cfg = config.load(TINY, [*BASE, *overrides])
    devices = jax.devices()[:1] if name == "single" else jax.devices()
    b = program.build(cfg, devices)
    step = program.jit_train_step(b)
    state, losses, biases = b.state, [], []
    with b.plan.rules():
        for batch in batches(cfg):
            state, metrics = step(state, program.put_batch(batch, b.batch_sharding))
            losses.append(float(metrics["loss"]))
            found = jax.tree_util.tree_leaves_with_path(jax.device_get(state.model_state))
            bias = [v for p, v in found if "selection_bias" in jax.tree_util.keystr(p)]
            biases.append(np.asarray(bias).tolist())
    return {"mesh": dict(b.mesh.shape), "step_losses": losses, "biases": biases}


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    out = {name: run_setting(name, ov) for name, ov in SETTINGS.items()}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
