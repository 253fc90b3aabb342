#!/usr/bin/env bash
# Greedy decoding with Qwen3-235B-A22B: moetext.generate on convert.sh's OUT (default
# ckpt/qwen3-235b-a22b) or a run's step directory (CHECKPOINT=RUN_DIR/checkpoints/<step>), two
# prompts, 32 new tokens each. moetext.generate is one process, so the bf16 params (~470 GB)
# must fit one host's chips: a tpu7x-8 host (4 Ironwood chips, 192 GB each, 8 JAX devices);
# every v5p/v6e/v5e host is too small (v5p-8: 4 x 95 GB). fsdp over the host's 8 devices; the
# KV cache holds data.seq_len=4096 slots. decode_aot.sh compiles this decode step for
# tpu7x:2x2x1 without a TPU: 60.1 GiB per device (a device is one of a chip's two TensorCores,
# with half its HBM, 96 GiB) at batch 8 (the prompts are padded to the 8 devices).
# Expect on stdout one completion per prompt (the text after it, up to EOS or 32 tokens), on
# stderr the load, compile and generation times (not run here: no TPU).
# Extra arguments go to moetext.generate (--prompt TEXT, --max_new_tokens N, --jsonl,
# section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../../.."
CHECKPOINT=${CHECKPOINT:-${OUT:-ckpt/qwen3-235b-a22b}}
exec .venv/bin/python -m moetext.generate "${MODEL_CONFIG:-configs/models/qwen3-235b-a22b.yml}" \
  --checkpoint "$CHECKPOINT" \
  --prompt "The capital of France is" \
  --prompt "def fibonacci(n):" \
  --max_new_tokens 32 --temperature 0 \
  model.param_dtype=bfloat16 sharding.preset=fsdp \
  "$@"
