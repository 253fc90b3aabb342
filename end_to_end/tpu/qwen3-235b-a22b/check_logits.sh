#!/usr/bin/env bash
# Logits of the converted Qwen3-235B-A22B (convert.sh's OUT) against transformers' on 4 prompts
# (scripts/check_hf_logits.py; tolerances and their reasons in docs/convert.md). Two steps, two
# Pythons, because torch and transformers are never moetext dependencies:
#   1. reference (skipped when REF/logits.npy exists): HF_PYTHON, a Python with torch and
#      transformers, runs Qwen3MoeForCausalLM from HF_DIR with eager attention and writes REF
#      (input_ids.npy, logits.npy <= 78 MB, reference.json). In HF_DTYPE=bfloat16 (default):
#      ~480 GB of RAM; HF_DTYPE=float32 needs ~940 GB. A bf16 reference is compared with looser
#      default bounds (atol 4, top-1 agreement >= 0.8 instead of 5e-2 and 0.9). A multi-GPU host
#      can run it instead: HF_DEVICE_MAP=auto (accelerate).
#   2. compare: moetext's forward of OUT in float32, fsdp over this host's devices. Params stay
#      bf16 as converted (model.param_dtype=bfloat16: lossless, each op upcasts them), ~470 GB
#      in all: one tpu7x-8 host (4 Ironwood chips, 768 GB of HBM) or a CPU host with ~600 GB of
#      RAM (JAX_PLATFORMS=cpu). Smaller TPU hosts cannot hold it (v5p-8: 380 GB); over several
#      hosts run the same command on each with distributed.initialize=always (not run here).
# Run the steps on different machines with STEP=reference / STEP=compare (default: both), e.g.
#   HF_DIR=/data/Qwen3-235B-A22B-Instruct-2507 HF_PYTHON=/tmp/hfvenv/bin/python STEP=reference \
#       bash end_to_end/tpu/qwen3-235b-a22b/check_logits.sh
#   STEP=compare bash end_to_end/tpu/qwen3-235b-a22b/check_logits.sh
# Expect one line per prompt (max |diff|, top-1 agreement, KL), then `ok: 4 prompts within ...`
# and exit 0; a failure prints `FAILED prompt i ...` and exits 1. Extra arguments go to compare
# (--atol A, --min_top1 F, section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-ckpt/qwen3-235b-a22b}
REF=${REF:-ckpt/qwen3-235b-a22b-logits-ref}
STEP=${STEP:-both}
case $STEP in
  reference | compare | both) ;;
  *) echo "error: STEP=$STEP is not one of reference, compare, both" >&2 && exit 2 ;;
esac
if [[ $STEP == reference || ($STEP == both && ! -f $REF/logits.npy) ]]; then
  HF_DIR=${HF_DIR:?set HF_DIR to the downloaded Qwen/Qwen3-235B-A22B-Instruct-2507 directory}
  HF_PYTHON=${HF_PYTHON:?set HF_PYTHON to a python with torch and transformers}
  "$HF_PYTHON" scripts/check_hf_logits.py reference --hf "$HF_DIR" --out "$REF" \
    --dtype "${HF_DTYPE:-bfloat16}" ${HF_DEVICE_MAP:+--device_map "$HF_DEVICE_MAP"}
fi
if [[ $STEP == compare || $STEP == both ]]; then
  exec .venv/bin/python scripts/check_hf_logits.py compare --checkpoint "$OUT" --reference "$REF" \
    model.param_dtype=bfloat16 sharding.preset=fsdp kernels.gmm_backend=ragged_dot "$@"
fi
