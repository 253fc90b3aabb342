"""The 8-device run of test_loss.py: `python -m tests.train.loss_sharded_worker`.

Runs in a fresh interpreter with 8 fake CPU devices (started by tests/fake_devices.py). The tiny
config (1 layer, f32) on one device with the logits loss is the reference; under fsdp and
fsdp_tp the fused loss (8 vocab chunks, or under fsdp_tp 4 token chunks) takes the same loss
and gradients. So does, against the
same reference at V = 500, the fused loss under fsdp split 2 x 4 as on a 3D TPU slice with
sharding.split_dense_gathers (the head gathered a chunk at a time in a shard_map, chunks of 128
rows, the last 12 rows padded: loss.chunking's multiple). Prints one JSON line: per setting the
loss and gradient errors against its reference and the numbers of all-to-alls and
reduce-scatters in the compiled loss + gradient.
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
from moetext.program import loss
from moetext.program.step import make_loss_fn

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
BASE = ["data.kind=synthetic", "checkpoint.enabled=false", "model.num_layers=1"]
FUSED = "model.loss_chunk_size=64"  # V = 512: 8 chunks of 64 rows
VOCAB = [FUSED, "model.loss_chunks=vocab"]
# Token chunks of 128 tokens (main() sets loss.TOKEN_CHUNK_LOGITS_BYTES): 4 of the 512 tokens.
TOKENS = [FUSED, "model.loss_chunks=tokens"]
TP = ["sharding.preset=fsdp_tp", "sharding.mesh.tensor=2"]  # fsdp = 4 x tensor = 2
SETTINGS = {
    "single-logits": (["sharding.mesh.fsdp=1", "model.loss_chunk_size=0"], 1),
    "fsdp-fused": (VOCAB, 8),
    "fsdp_tp-logits": ([*TP, "model.loss_chunk_size=0"], 8),
    "fsdp_tp-fused": ([*TP, *VOCAB], 8),
    "fsdp_tp-tokens": ([*TP, *TOKENS], 8),
}
V500 = "model.vocab_size=500"
SPLIT = {  # run with the fsdp axis split 2 x 4; compared with single-logits-v500
    "single-logits-v500": (["sharding.mesh.fsdp=1", "model.loss_chunk_size=0", V500], 1),
    "fsdp_split-fused-v500": ([*VOCAB, V500, "sharding.split_dense_gathers=true"], 8),
}


def run_setting(overrides: list[str], devices: int) -> dict[str, Any]:
    cfg = config.load(TINY, [*BASE, *overrides])
    b = program.build(cfg, jax.devices()[:devices])
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batch = program.put_batch(data.next_batch(), b.batch_sharding)
    data.close()
    grad_fn = jax.value_and_grad(make_loss_fn(b.graphdef, b.rest), has_aux=True)

    def loss_and_grads(params: Any, batch: Any) -> tuple[Any, Any]:
        (loss, _), grads = grad_fn(params, batch)
        return loss, grads

    jitted = jax.jit(loss_and_grads, in_shardings=(b.state_shardings.params, b.batch_sharding))
    compiled = program.lower_checked(b, jitted, b.state.params, batch).compile()
    loss, grads = compiled(b.state.params, batch)
    return {
        "loss": float(loss),
        "grads": jax.tree.map(np.asarray, jax.device_get(grads)),
        "all_to_alls": len(re.findall(r" all-to-all\(", compiled.as_text())),
        "reduce_scatters": len(re.findall(r" reduce-scatter\(", compiled.as_text())),
        "reduce_scatter_shapes": sorted(
            set(re.findall(r"= (\w+\[[\d,]*\])\S* reduce-scatter\(", compiled.as_text()))
        ),
    }


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    loss.TOKEN_CHUNK_LOGITS_BYTES = 128 * 512 * 4  # V = 512: 128 of the step's 512 tokens
    results = {name: run_setting(ov, n) for name, (ov, n) in SETTINGS.items()}
    with split_like_a_3d_slice():
        results.update({name: run_setting(ov, n) for name, (ov, n) in SPLIT.items()})
    out = {}
    for name, r in results.items():
        ref = results["single-logits-v500" if name in SPLIT else "single-logits"]
        errs = jax.tree.map(
            lambda a, b: float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)),
            r["grads"],
            ref["grads"],
        )
        out[name] = {
            "loss_rel": abs(r["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_rel": max(jax.tree.leaves(errs)),
            "all_to_alls": r["all_to_alls"],
            "reduce_scatters": r["reduce_scatters"],
            "reduce_scatter_shapes": r["reduce_scatter_shapes"],
        }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
