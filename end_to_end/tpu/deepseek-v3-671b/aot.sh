#!/usr/bin/env bash
# Ahead-of-time compile of the DeepSeek-V3-671B train step (MTP on, as released) for a v5p-1024
# slice (8x8x8 = 512 chips), 1 x 4096 tokens per chip (MaxText's recipe shape), pure FSDP over
# all 512 chips. No TPU needed (libtpu topology). Prints memory per chip, FLOPs and
# collectives; exits 1 if the step does not fit in HBM.
#   bash end_to_end/tpu/deepseek-v3-671b/aot.sh          # bf16 experts
#   FP8=1 bash end_to_end/tpu/deepseek-v3-671b/aot.sh    # FP8 experts + quantized all-gather
# FP8=1 adds kernels.quantization=fp8_blockwise kernels.recipe.qag=true (docs/performance.md
# "The whole FP8 + QAG step against bf16"). Extra arguments are appended overrides, e.g.
# sharding.preset=fsdp_ep sharding.mesh.expert=8.
# Not compiled where this script was written (too slow for the 2-core machine it was written
# on); its overrides were checked against the config schema only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
QUANT=()
[[ "${FP8:-0}" == 1 ]] && QUANT=(kernels.quantization=fp8_blockwise kernels.recipe.qag=true)
exec .venv/bin/python scripts/aot_compile.py configs/models/deepseek-v3-671b.yml \
  topology=v5p:8x8x8 \
  sharding.preset=fsdp \
  data.global_batch_size=512 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" \
  "${QUANT[@]}" \
  "$@"
