#!/usr/bin/env bash
# Ahead-of-time compile of the Qwen3-235B-A22B decode step that decode.sh runs (one new token per
# row against a 4096-slot KV cache, bf16 params, prefused experts, fsdp) at batch 8, for
# TOPOLOGY (default tpu7x:2x2x1: one tpu7x-8 host, 4 chips = 8 JAX devices). No TPU needed
# (libtpu topology). Prints one JSON line: memory per device against HBM ("fits"), XLA's FLOPs
# and bytes accessed, lower and compile times; exits 1 if it does not fit. Measured on tpu7x:2x2x1:
#   56.14 of 96 GiB per device (55.47 arguments + 0.67 temporaries + 0.74 outputs - 0.73 alias;
#   a device is one of the chip's two TensorCores, with half of its 192 GiB);
#   compile 204 s on 2 shared CPU cores (too slow for CI, which compiles the 30B step).
# scripts/bench_decode.py --aot compiles only qwen3-30b-a3b, hence moetext.aot directly here.
# Extra arguments are config overrides (e.g. sharding.preset=fsdp_ep sharding.mesh.expert=8).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python - "${TOPOLOGY:-tpu7x:2x2x1}" "$@" <<'PY'
import json
import sys

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from jax.errors import JaxRuntimeError

from moetext import aot, config, models  # noqa: F401  (models: the families register)

topology, overrides = sys.argv[1], sys.argv[2:]
cfg = config.load(
    "configs/models/qwen3-235b-a22b.yml",
    ["model.param_dtype=bfloat16", "sharding.preset=fsdp", *overrides],
)
try:
    r = aot.compile_decode_step(cfg, topology, batch=8, cache_len=4096)
except JaxRuntimeError as e:
    if not aot.exceeds_hbm(e):
        raise
    print(f"topology {topology}: DOES NOT FIT: {str(e).splitlines()[0]}")
    sys.exit(1)
print(json.dumps({"aot": r}))
sys.exit(0 if r["fits"] else 1)
PY
