#!/usr/bin/env bash
# Greedy decoding with Qwen3-30B-A3B: moetext.generate on convert.sh's OUT (default
# ckpt/qwen3-30b-a3b) or a run's step directory (CHECKPOINT=RUN_DIR/checkpoints/<step>), two
# prompts, 32 new tokens each, on one TPU VM host (moetext.generate is one process): a v5e-8
# (v5e:2x4), v6e-4 (v6e:2x2) or v5p-8. Params in bf16 (as converted; a run's float32 params are
# cast on load), fsdp over the host's chips; the KV cache holds data.seq_len=4096 slots.
# decode_aot.sh compiles this decode step for v5e:2x4 and v6e:2x2 without a TPU: it fits in
# 7.5 of 16 GiB (v5e) and 15.0 of 32 GiB per chip (v6e) at batch 8 (the two prompts are padded
# to a multiple of the chips: 8 rows on v5e-8, 4 on v6e-4).
# Expect on stdout one completion per prompt (the text after it, up to EOS or 32 tokens; the
# first should name Paris), on stderr the load, compile and generation times.
# Extra arguments go to moetext.generate (--prompt TEXT, --max_new_tokens N, --jsonl,
# section.key=value).
set -euo pipefail
cd "$(dirname "$0")/../../.."
CHECKPOINT=${CHECKPOINT:-${OUT:-ckpt/qwen3-30b-a3b}}
exec .venv/bin/python -m moetext.generate "${MODEL_CONFIG:-configs/models/qwen3-30b-a3b.yml}" \
  --checkpoint "$CHECKPOINT" \
  --prompt "The capital of France is" \
  --prompt "def fibonacci(n):" \
  --max_new_tokens 32 --temperature 0 \
  model.param_dtype=bfloat16 sharding.preset=fsdp \
  "$@"
