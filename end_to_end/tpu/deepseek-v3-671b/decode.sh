#!/usr/bin/env bash
# Greedy decoding with DeepSeek-V3-671B: moetext.generate on convert.sh's OUT (default
# ckpt/deepseek-v3-671b) or a run's step directory (CHECKPOINT=RUN_DIR/checkpoints/<step>), two
# prompts, 32 new tokens each, with the latent KV cache (kv_lora_rank + qk_rope_head_dim = 576
# values per token per layer; the MTP module is dropped for generation). moetext.generate runs in
# one process (docs/generate.md), so the ~1.34 TB of bf16 params must fit in one host's memory:
# no TPU VM host has that much HBM today (v5p-8: 4 x 95 GiB; tpu7x-8: 4 x 192 GB), so until
# generation runs multi-host this runs on a CPU host with ~1.5 TB of RAM (JAX_PLATFORMS=cpu,
# slow). The tokenizer is the checkpoint's (convert.sh copies DeepSeek-V3's tokenizer.json);
# --tokenizer FILE picks another.
# Expect on stdout one completion per prompt, on stderr the load, compile and generation times.
# Extra arguments go to moetext.generate (--prompt TEXT, --max_new_tokens N, --jsonl,
# section.key=value). Not run where this script was written (no TPU, no weights).
set -euo pipefail
cd "$(dirname "$0")/../../.."
CHECKPOINT=${CHECKPOINT:-${OUT:-ckpt/deepseek-v3-671b}}
exec .venv/bin/python -m moetext.generate "${MODEL_CONFIG:-configs/models/deepseek-v3-671b.yml}" \
  --checkpoint "$CHECKPOINT" \
  --prompt "The capital of France is" \
  --prompt "def fibonacci(n):" \
  --max_new_tokens 32 --temperature 0 \
  model.param_dtype=bfloat16 sharding.preset=fsdp \
  "$@"
