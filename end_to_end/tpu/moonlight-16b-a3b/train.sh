#!/usr/bin/env bash
# Train Moonlight-16B-A3B on a v5p-64 slice (8 TPU VM hosts x 4 chips). Run this same command
# on every host, e.g.
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all --command="cd moetext && \
#       bash end_to_end/tpu/moonlight-16b-a3b/train.sh"
# distributed.initialize=always: jax.distributed discovers the coordinator, process count and
# process id from the TPU VM metadata, before any device is used. Check the plan first with
# aot.sh (same preset, mesh and batch); FP8=1 trains with the FP8 + QAG experts it compiles.
# checkpoint.load_params_from=$OUT (convert.sh's output) fine-tunes the released weights; the
# data needs a tokenizer with Moonlight's 163840-entry vocabulary (data.tokenizer=FILE).
# Not run where this script was written (no TPU).
set -euo pipefail
cd "$(dirname "$0")/../../.."
QUANT=()
[[ "${FP8:-0}" == 1 ]] && QUANT=(kernels.quantization=fp8_blockwise kernels.recipe.qag=true)
exec .venv/bin/python -m train configs/models/moonlight-16b-a3b.yml \
  distributed.initialize=always \
  sharding.preset=fsdp \
  data.global_batch_size=32 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-auto}" \
  "${QUANT[@]}" \
  train.run_dir="${RUN_DIR:-gs://YOUR_BUCKET/runs/moonlight-16b-a3b}" \
  train.progress_bar=false \
  "$@"
