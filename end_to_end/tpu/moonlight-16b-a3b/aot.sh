#!/usr/bin/env bash
# Ahead-of-time compile of the Moonlight-16B-A3B train step for a v5p-64 slice (4x4x2 = 32
# chips), 1 x 4096 tokens per chip, pure FSDP over all 32 chips. No TPU needed (libtpu
# topology). Prints memory per chip, FLOPs and collectives; exits 1 if the step does not fit.
#   bash end_to_end/tpu/moonlight-16b-a3b/aot.sh          # bf16 experts
#   FP8=1 bash end_to_end/tpu/moonlight-16b-a3b/aot.sh    # FP8 experts + quantized all-gather
# FP8=1 adds kernels.quantization=fp8_blockwise kernels.recipe.qag=true (docs/performance.md
# "The whole FP8 + QAG step against bf16"). Extra arguments are appended overrides.
# Not compiled where this script was written (too slow for the 2-core machine it was written
# on); its overrides were checked against the config schema only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
QUANT=()
[[ "${FP8:-0}" == 1 ]] && QUANT=(kernels.quantization=fp8_blockwise kernels.recipe.qag=true)
exec .venv/bin/python scripts/aot_compile.py configs/models/moonlight-16b-a3b.yml \
  topology=v5p:4x4x2 \
  sharding.preset=fsdp \
  data.global_batch_size=32 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" \
  "${QUANT[@]}" \
  "$@"
