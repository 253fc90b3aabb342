#!/usr/bin/env bash
# Released DeepSeek-V3 weights (FP8) -> a bf16 moetext checkpoint that train.sh fine-tunes from
# and decode.sh decodes:
#   HF_DIR=/data/DeepSeek-V3 bash end_to_end/tpu/deepseek-v3-671b/convert.sh
#   bash end_to_end/tpu/deepseek-v3-671b/train.sh checkpoint.load_params_from=$OUT
# Get the weights first (not a moetext dependency), e.g.
#   huggingface-cli download deepseek-ai/DeepSeek-V3 --local-dir $HF_DIR
# (V3-0324, V3.1 and R1 share the shape and the FP8 layout.) The attention, dense-MLP and expert
# projections are stored float8_e4m3fn with 128x128 block scales (weight_scale_inv):
# hf-to-orbax dequantizes them block row by block row while streaming (docs/convert.md
# "Released FP8 weights") and writes --dtype bfloat16. The MTP module (model.layers.61.*)
# converts too (model.mtp_layers: 1 in the shipped config); its copies of embed_tokens and
# shared_head.head are checked against the main ones.
# Run on one host (any machine with the disk; no TPU needed). Expect:
#   disk: the download (~690 GB FP8) + a staging copy of the re-laid-out bf16 tensors next to
#         OUT (~1.37 TB, deleted at the end) + OUT itself (~1.37 TB bf16);
#   RAM:  a few GB (tensors memory-mapped; dequantization holds about two float32 block rows);
#   time: bound by disk throughput.
# OUT must then be readable by every host of the run: copy it to a bucket
# (gsutil -m cp -r $OUT gs://BUCKET/...) and pass that path to load_params_from.
# --config checks every shape field of the shipped config against config.json and names any
# difference (MODEL_CONFIG=<your yml> to use another, e.g. configs/models/kimi-k2.yml).
# Not run where this script was written (no weights, no disk): the same FP8 path is tested on
# tiny FP8 fixtures with partial blocks (tests/convert/, docs/convert.md).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HF_DIR=${HF_DIR:?set HF_DIR to the downloaded deepseek-ai/DeepSeek-V3 directory}
OUT=${OUT:-ckpt/deepseek-v3-671b}
exec .venv/bin/python -m moetext.convert hf-to-orbax --hf "$HF_DIR" --out "$OUT" \
  --config "${MODEL_CONFIG:-configs/models/deepseek-v3-671b.yml}" --dtype bfloat16 "$@"
