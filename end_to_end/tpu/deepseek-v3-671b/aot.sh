#!/usr/bin/env bash
# Ahead-of-time compile of the DeepSeek-V3-671B train step (MTP on, as released) for a v5p-1024
# slice (8x8x8 = 512 chips), 1 x 4096 tokens per chip (MaxText's recipe shape), pure FSDP over
# all 512 chips. No TPU needed (libtpu topology). Prints memory per chip, FLOPs and
# collectives; exits 1 if the step does not fit in HBM.
#   bash end_to_end/tpu/deepseek-v3-671b/aot.sh          # bf16 experts
#   FP8=1 bash end_to_end/tpu/deepseek-v3-671b/aot.sh    # FP8 experts + quantized all-gather
# FP8=1 adds kernels.quantization=fp8_blockwise kernels.recipe.qag=true (docs/performance.md
# "The whole FP8 + QAG step against bf16") on the pallas_tpu gmm (what gmm_backend: auto runs
# on TPU); bf16 compiles ragged_dot; GMM_BACKEND= overrides either. Extra arguments are appended
# overrides, e.g. sharding.preset=fsdp_ep sharding.mesh.expert=8.
# Compiled on a 2-core host in ~5 min each (docs/performance.md "DeepSeek-V3-671B: AOT memory
# per chip on v5p-1024"): bf16 68.86 GiB, FP8 + QAG 51.63 GiB per chip (95.41 on ragged_dot).
set -euo pipefail
cd "$(dirname "$0")/../../.."
QUANT=()
BACKEND=ragged_dot
if [[ "${FP8:-0}" == 1 ]]; then
  QUANT=(kernels.quantization=fp8_blockwise kernels.recipe.qag=true)
  BACKEND=pallas_tpu  # ragged_dot dequantises whole expert weights: 95.41 GiB, over HBM
fi
exec .venv/bin/python scripts/aot_compile.py configs/models/deepseek-v3-671b.yml \
  topology=v5p:8x8x8 \
  sharding.preset=fsdp \
  data.global_batch_size=512 data.seq_len=4096 \
  kernels.gmm_backend="${GMM_BACKEND:-$BACKEND}" \
  "${QUANT[@]}" \
  "$@"
