#!/usr/bin/env bash
# Logits of the converted Qwen3-30B-A3B (convert.sh's OUT) against transformers' on 4 prompts
# (scripts/check_hf_logits.py; tolerances and their reasons in docs/convert.md). Two steps, two
# Pythons, because torch and transformers are never moetext dependencies:
#   1. reference (skipped when REF/logits.npy exists): HF_PYTHON, a Python with torch and
#      transformers, runs Qwen3MoeForCausalLM from HF_DIR in float32 with eager attention and
#      writes REF (input_ids.npy, logits.npy: 4 prompts x <= 32 tokens x 151936 x 4 B <= 78 MB,
#      reference.json). Needs ~125 GB of RAM (float32 weights); CPU, a few minutes.
#   2. compare: moetext's forward of OUT in float32 on this host's devices, fsdp over all of
#      them. Params stay bf16 as converted (model.param_dtype=bfloat16: lossless, each op
#      upcasts them to float32), ~61 GB in all, plus float32 temporaries: one TPU VM host with
#      room for both, e.g. v5p-8 (4 x 95 GB; this forward was not compiled ahead of time), or a
#      CPU host with ~100 GB of RAM (JAX_PLATFORMS=cpu). gmm_backend ragged_dot: XLA's grouped
#      matmul, run at float32 precision like every other matmul of the check.
# Run the steps on different machines with STEP=reference / STEP=compare (default: both), e.g.
#   HF_DIR=/data/Qwen3-30B-A3B-Instruct-2507 HF_PYTHON=/tmp/hfvenv/bin/python STEP=reference \
#       bash end_to_end/tpu/qwen3-30b-a3b/check_logits.sh
#   STEP=compare bash end_to_end/tpu/qwen3-30b-a3b/check_logits.sh
# Expect one line per prompt (max |diff|, top-1 agreement, KL), then `ok: 4 prompts within atol
# 0.05 ...` and exit 0; a failure prints `FAILED prompt i ...` and exits 1. Extra arguments go
# to compare (--atol A, --min_top1 F, section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-ckpt/qwen3-30b-a3b}
REF=${REF:-ckpt/qwen3-30b-a3b-logits-ref}
STEP=${STEP:-both}
case $STEP in
  reference | compare | both) ;;
  *) echo "error: STEP=$STEP is not one of reference, compare, both" >&2 && exit 2 ;;
esac
if [[ $STEP == reference || ($STEP == both && ! -f $REF/logits.npy) ]]; then
  HF_DIR=${HF_DIR:?set HF_DIR to the downloaded Qwen/Qwen3-30B-A3B-Instruct-2507 directory}
  HF_PYTHON=${HF_PYTHON:?set HF_PYTHON to a python with torch and transformers}
  "$HF_PYTHON" scripts/check_hf_logits.py reference --hf "$HF_DIR" --out "$REF" --dtype float32
fi
if [[ $STEP == compare || $STEP == both ]]; then
  exec .venv/bin/python scripts/check_hf_logits.py compare --checkpoint "$OUT" --reference "$REF" \
    model.param_dtype=bfloat16 sharding.preset=fsdp kernels.gmm_backend=ragged_dot "$@"
fi
