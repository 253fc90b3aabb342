"""The 8-device run of test_equivalence.py: `python -m tests.sharding.equivalence_worker`.

Runs in a fresh interpreter with 8 fake CPU devices (started by tests/fake_devices.py).

Builds the tiny config on one device and under each sharding setting, and prints one JSON line:
per setting the loss and gradient errors against the one-device run, the losses of three real
train steps, and the PartitionSpecs of a few parameters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

# isort: split
import jax
import numpy as np

from fake_devices import split_like_a_3d_slice
from moetext import config, program
from moetext import data as data_lib
from moetext.kernels.gmm import gather
from moetext.program.step import make_loss_fn, make_train_step

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
# One decoder layer (MoE) keeps the four 8-device compiles cheap on a shared 2-core host.
BASE = [
    # Adam's update m / (sqrt(v) + eps) is ill-conditioned where |g| ~ eps: with the default
    # 1e-8 a rounding-level gradient difference at such an entry moves it by a sizeable fraction
    # of the learning rate (seen: an embedding row, 1.2e-4 of max|embed|). eps = 1e-3 makes the
    # update Lipschitz in g for small entries, so the comparison tests the sharding, not luck.
    "optim.eps=1e-3",
    "train.steps=3",
    "checkpoint.enabled=false",
    "train.progress_bar=false",
    "model.num_layers=1",
]
SETTINGS = {
    "single": ["sharding.preset=fsdp", "sharding.mesh.fsdp=1"],
    "fsdp": ["sharding.preset=fsdp"],
    "fsdp_tp": ["sharding.preset=fsdp_tp", "sharding.mesh.tensor=2", "sharding.dcn_mesh.data=2"],
    "fsdp_ep": ["sharding.preset=fsdp_ep", "sharding.mesh.expert=4"],
}
# The settings again with the expert-weight gradient reduce-scattered in tiles
# (kernels/gmm/gather.py: reduce_scatter_tiled), forced on the tiny shapes by shrinking the tile
# budget: 4 tiles of 16 columns (fsdp: along the ungathered F; fsdp_tp: F is split over tensor
# too, so along a gathered dim, each shard's block in 4 pieces).
TILED = {"fsdp_tiled": "fsdp", "fsdp_tp_tiled": "fsdp_tp"}
# The fsdp setting again as on a 3D TPU slice: the 8-device fsdp axis split into 2 x 4
# (sharding/torus.py), which CPU devices (no torus coordinates) never need, with
# sharding.split_dense_gathers on. The experts' gathers and the dense layers' matmuls
# (sharding/fsdp.py) then run per sub-axis in their shard_maps.
# fsdp_tp at its shipped tensor = 1 takes the same path (its weights name the size-1 axis).
# fsdp_ep's dense weights, split over fsdp x expert (2 x 4), are gathered one axis at a time
# on the unsplit mesh, as where the pair spans three torus dims and neither axis alone does.
SPLIT = {
    "fsdp_split": [*SETTINGS["fsdp"], "sharding.split_dense_gathers=true"],
    "fsdp_tp1_split": ["sharding.preset=fsdp_tp", "sharding.split_dense_gathers=true"],
    "fsdp_ep_split": [*SETTINGS["fsdp_ep"], "sharding.split_dense_gathers=true"],
}
SPEC_PATHS = {
    "embed": ("embed",),
    "w_q": ("layers", 0, "attn", "w_q"),
    "w_k": ("layers", 0, "attn", "w_k"),
    "experts.w_gate": ("layers", 0, "mlp", "experts", "w_gate"),
    "experts.w_down": ("layers", 0, "mlp", "experts", "w_down"),
    "lm_head": ("lm_head",),
}


def run_setting(name: str, overrides: list[str]) -> dict[str, Any]:
    cfg = config.load(TINY, [*BASE, *overrides])
    devices = jax.devices()[:1] if name == "single" else jax.devices()
    b = program.build(cfg, devices)
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batches = [program.put_batch(data.next_batch(), b.batch_sharding) for _ in range(3)]
    data.close()
    grad_fn = jax.value_and_grad(make_loss_fn(b.graphdef, b.rest), has_aux=True)
    train_step = make_train_step(b.graphdef, b.rest, b.tx, b.lr_schedule)

    def step_and_grads(state: Any, batch: Any) -> tuple[Any, Any, Any, Any]:
        # One compile per setting: the real train step, plus the gradients it takes (XLA
        # shares the forward/backward between the two outputs).
        (loss, _), grads = grad_fn(state.params, batch)
        new_state, metrics = train_step(state, batch)
        return new_state, metrics, loss, grads

    jitted = jax.jit(
        step_and_grads,
        in_shardings=(b.state_shardings, b.batch_sharding),
        out_shardings=(
            b.state_shardings,
            b.plan.replicated,
            b.plan.replicated,
            b.state_shardings.params,
        ),
    )
    step = program.lower_checked(b, jitted, b.state, batches[0]).compile()
    state, losses = b.state, []
    for i, batch in enumerate(batches):
        state, metrics, loss, grads = step(state, batch)
        losses.append(float(metrics["loss"]))
        if i == 0:
            first_loss, first_grads = float(loss), jax.tree.map(np.asarray, jax.device_get(grads))
    specs = {}
    for key, path in SPEC_PATHS.items():
        node = state.params
        for p in path:
            node = node[p]
        specs[key] = [list(a) if isinstance(a, tuple) else a for a in node.sharding.spec]
    return {
        "mesh": dict(b.mesh.shape),
        "loss": first_loss,
        "grads": first_grads,
        "step_losses": losses,
        "params": jax.tree.map(np.asarray, jax.device_get(state.params)),
        "specs": specs,
        # Collective ops of the compiled step (CPU), e.g. {"all-gather": 14, ...}.
        "collectives": collective_counts(step.as_text() or ""),
    }


def collective_counts(hlo: str) -> dict[str, int]:
    ops = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in ops}


def max_rel(a: Any, b: Any) -> float:
    """max over leaves of max|a - b| / max|b| (norm-wise relative error per tensor)."""
    errs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)), a, b
    )
    return max(jax.tree.leaves(errs))


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    results = {name: run_setting(name, ov) for name, ov in SETTINGS.items()}
    with gather.grad_tile_limits(1, 16):
        results.update({name: run_setting(name, SETTINGS[of]) for name, of in TILED.items()})
    with split_like_a_3d_slice():
        results.update({name: run_setting(name, ov) for name, ov in SPLIT.items()})
    ref = results["single"]
    out = {}
    for name, r in results.items():
        out[name] = {
            "mesh": r["mesh"],
            "loss_rel": abs(r["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_rel": max_rel(r["grads"], ref["grads"]),
            "step_losses": r["step_losses"],
            "param_rel": max_rel(r["params"], ref["params"]),
            "specs": r["specs"],
            "collectives": r["collectives"],
        }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
