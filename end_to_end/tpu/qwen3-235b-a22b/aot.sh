#!/usr/bin/env bash
# Ahead-of-time compile of the Qwen3-235B-A22B train step for a v5p-256 slice (8x4x4 = 128 chips),
# 1 x 4096 tokens per chip, pure FSDP over all 128 chips. No TPU needed (libtpu topology).
# Prints memory per chip, FLOPs and collectives; exits 1 if the step does not fit in HBM.
# 45.30 GB (42.19 GiB) per chip on 2026-11-26, as two programs (train.separate_update): 22.05
# arguments (params + Adam, f32) + temporaries + the gradients handed to the update (MaxText:
# 45.4 GB); docs/performance.md "The step as two programs". GMM_BACKEND=pallas_tpu: 44.42 GB
# (41.37 GiB; "`w_down` gathered with its minor dims swapped"). It first fit with the per-shard
# shard_map MoE dispatch (59.17 GB); the global-argsort dispatch before it did not fit.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python scripts/aot_compile.py configs/models/qwen3-235b-a22b.yml \
  topology=v5p:8x4x4 \
  sharding.preset=fsdp \
  data.global_batch_size=128 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" \
  "$@"
