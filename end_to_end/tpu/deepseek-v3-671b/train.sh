#!/usr/bin/env bash
# Train DeepSeek-V3-671B (MTP on) on a v5p-1024 slice (128 TPU VM hosts x 4 chips). Run this
# same command on every host, e.g.
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all --command="cd moetext && \
#       bash end_to_end/tpu/deepseek-v3-671b/train.sh"
# distributed.initialize=always: jax.distributed discovers the coordinator, process count and
# process id from the TPU VM metadata, before any device is used. Check the plan first with
# aot.sh (same preset, mesh and batch); FP8=1 trains with the FP8 + QAG experts it compiles.
# checkpoint.load_params_from=$OUT (convert.sh's output) fine-tunes the released weights.
# Not run where this script was written (no TPU).
set -euo pipefail
cd "$(dirname "$0")/../../.."
QUANT=()
[[ "${FP8:-0}" == 1 ]] && QUANT=(kernels.quantization=fp8_blockwise kernels.recipe.qag=true)
exec .venv/bin/python -m train configs/models/deepseek-v3-671b.yml \
  distributed.initialize=always \
  sharding.preset=fsdp \
  data.global_batch_size=512 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-auto}" \
  "${QUANT[@]}" \
  train.run_dir="${RUN_DIR:-gs://YOUR_BUCKET/runs/deepseek-v3-671b}" \
  train.progress_bar=false \
  "$@"
