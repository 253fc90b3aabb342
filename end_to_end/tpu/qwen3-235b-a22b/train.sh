#!/usr/bin/env bash
# Train Qwen3-235B-A22B on a v5p-256 slice (32 TPU VM hosts x 4 chips). Run this same command on
# every host, e.g.
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all --command="cd moetext && \
#       bash end_to_end/tpu/qwen3-235b-a22b/train.sh"
# distributed.initialize=always: jax.distributed discovers the coordinator, process count and
# process id from the TPU VM metadata, before any device is used. Check the plan first with
# aot.sh (same preset, mesh and batch).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python -m train configs/models/qwen3-235b-a22b.yml \
  distributed.initialize=always \
  sharding.preset=fsdp \
  data.global_batch_size=128 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-auto}" \
  train.run_dir="${RUN_DIR:-gs://YOUR_BUCKET/runs/qwen3-235b-a22b}" \
  train.progress_bar=false \
  "$@"
