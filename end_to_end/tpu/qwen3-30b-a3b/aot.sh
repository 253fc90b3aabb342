#!/usr/bin/env bash
# Ahead-of-time compile of the Qwen3-30B-A3B train step for a v5p-64 slice (4x4x2 = 32 chips),
# 1 x 4096 tokens per chip, pure FSDP over all 32 chips. No TPU needed (libtpu topology).
# Prints memory per chip, FLOPs and collectives; exits 1 if the step does not fit in HBM.
# 19.88 GB (18.51 GiB) per chip on 2026-11-26 with ragged_dot, 19.43 GB (18.10 GiB) with
# GMM_BACKEND=pallas_tpu (MaxText: 20.1 GB); docs/performance.md "AOT memory per chip".
# Expert parallelism with a bounded exchange (the step-cost table's second moetext column):
#   bash end_to_end/tpu/qwen3-30b-a3b/aot.sh sharding.preset=fsdp_ep sharding.mesh.expert=8 \
#     moe.ep_buffer_factor=1.0 kernels.gmm_backend=pallas_tpu cost=true
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python scripts/aot_compile.py configs/models/qwen3-30b-a3b.yml \
  topology=v5p:4x4x2 \
  sharding.preset=fsdp \
  data.global_batch_size=32 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" \
  "$@"
