"""checkpoint.load_params_from on 4 fake devices: each device holds only its shard.

python -m tests.convert.load_params_worker CONVERTED_DIR HF_DIR
"""

from __future__ import annotations

import json
import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)

import jax  # isort: skip
import numpy as np
from flax import nnx

from moetext import checkpoint, config, program
from moetext.convert.hf import load_model

ckpt, hf = sys.argv[1], sys.argv[2]
cfg = config.load(
    f"{ckpt}/config.yml",
    ["model.dtype=float32", "data.global_batch_size=4", "sharding.preset=fsdp"],
)
plan = program.make_plan(cfg)
params = checkpoint.load_params(ckpt, cfg, program.params_target(cfg, plan))
_, ref = load_model(hf)
got = nnx.to_pure_dict(params)
want = nnx.to_pure_dict(nnx.state(ref, nnx.Param))
equal = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
)
w_q = got["layers"][1]["attn"]["w_q"]
print(
    "RESULT "
    + json.dumps(
        {
            "devices": jax.device_count(),
            "equal": equal,
            "w_q_global": list(w_q.shape),
            "w_q_shards": sorted({tuple(s.data.shape) for s in w_q.addressable_shards}),
            "w_q_spec": str(w_q.sharding.spec),
        }
    )
)
