#!/usr/bin/env bash
# Released Moonlight-16B-A3B weights (bf16, model_type deepseek_v3) -> a moetext checkpoint that
# train.sh fine-tunes from and decode.sh decodes:
#   HF_DIR=/data/Moonlight-16B-A3B bash end_to_end/tpu/moonlight-16b-a3b/convert.sh
#   bash end_to_end/tpu/moonlight-16b-a3b/train.sh checkpoint.load_params_from=$OUT
# Get the weights first (not a moetext dependency), e.g.
#   huggingface-cli download moonshotai/Moonlight-16B-A3B --local-dir $HF_DIR
# Moonlight ships bf16 safetensors (no FP8, no MTP module) and a tiktoken tokenizer
# (tiktoken.model), which moetext does not read: the conversion warns that the source has no
# tokenizer.json; bring a tokenizer.json or a sentencepiece model for decode.sh (TOKENIZER).
# Run on one host (any machine with the disk; no TPU needed). Expect:
#   disk: the download (~32 GB bf16) + a staging copy next to OUT (~32 GB, deleted at the end)
#         + OUT itself (~32 GB);
#   RAM:  a few GB (tensors are memory-mapped);
#   time: bound by disk throughput.
# OUT must then be readable by every host of the run: copy it to a bucket
# (gsutil -m cp -r $OUT gs://BUCKET/...) and pass that path to load_params_from.
# --config checks every shape field of the shipped config against config.json and names any
# difference (the shipped config was written from the published config.json as remembered:
# a mismatch reported here is the yml's to fix). Not run where this script was written.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HF_DIR=${HF_DIR:?set HF_DIR to the downloaded moonshotai/Moonlight-16B-A3B directory}
OUT=${OUT:-ckpt/moonlight-16b-a3b}
exec .venv/bin/python -m moetext.convert hf-to-orbax --hf "$HF_DIR" --out "$OUT" \
  --config "${MODEL_CONFIG:-configs/models/moonlight-16b-a3b.yml}" "$@"
