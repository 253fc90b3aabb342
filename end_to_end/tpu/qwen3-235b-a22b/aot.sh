#!/usr/bin/env bash
# Ahead-of-time compile of the Qwen3-235B-A22B train step for a v5p-256 slice (8x4x4 = 128 chips),
# 1 x 4096 tokens per chip, pure FSDP over all 128 chips. No TPU needed (libtpu topology).
# Prints memory per chip, FLOPs and collectives; exits 1 if the step does not fit in HBM.
# Fits since the per-shard shard_map MoE dispatch: 59.17 GB per chip = 22.05 arguments (params +
# Adam, f32) + 37.13 temporaries (MaxText: 45.4); docs/performance.md "AOT memory per chip".
# (The global-argsort dispatch before it needed 127.7 GB of temporaries and exited 1.)
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python scripts/aot_compile.py configs/models/qwen3-235b-a22b.yml \
  topology=v5p:8x4x4 \
  sharding.preset=fsdp \
  data.global_batch_size=128 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" \
  "$@"
