#!/usr/bin/env bash
# Released Qwen3-235B-A22B-Instruct-2507 weights -> a moetext checkpoint that train.sh fine-tunes from:
#   HF_DIR=/data/Qwen3-235B-A22B-Instruct-2507 bash end_to_end/tpu/qwen3-235b-a22b/convert.sh
#   bash end_to_end/tpu/qwen3-235b-a22b/train.sh checkpoint.load_params_from=$OUT
# Get the weights first (not a moetext dependency), e.g.
#   huggingface-cli download Qwen/Qwen3-235B-A22B-Instruct-2507 --local-dir $HF_DIR
# Run on one host (any machine with the disk; no TPU needed). Expect:
#   disk: the download (~470 GB bf16) + a scratch copy of the re-laid-out tensors in a staging
#         directory next to OUT (~470 GB, deleted at the end) + OUT itself (~470 GB);
#   RAM:  a few GB (tensors are memory-mapped, orbax writes 8 MiB chunks; see docs/convert.md);
#   time: bound by disk throughput (~3 x 470 GB written/read).
# OUT must then be readable by every host of the run: copy it to a bucket
# (gsutil -m cp -r $OUT gs://BUCKET/...) and pass that path to load_params_from.
# --config checks every shape field of the shipped config against config.json and names any
# difference (the shipped rope_theta is the 2507 Instruct release's; the original release
# differs: pass MODEL_CONFIG=<your yml> or drop --config to derive it from config.json).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HF_DIR=${HF_DIR:?set HF_DIR to the downloaded Qwen/Qwen3-235B-A22B-Instruct-2507 directory}
OUT=${OUT:-ckpt/qwen3-235b-a22b}
exec .venv/bin/python -m moetext.convert hf-to-orbax --hf "$HF_DIR" --out "$OUT" \
  --config "${MODEL_CONFIG:-configs/models/qwen3-235b-a22b.yml}" "$@"
