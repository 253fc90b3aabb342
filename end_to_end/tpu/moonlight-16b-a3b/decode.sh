#!/usr/bin/env bash
# Greedy decoding with Moonlight-16B-A3B: moetext.generate on convert.sh's OUT (default
# ckpt/moonlight-16b-a3b) or a run's step directory (CHECKPOINT=RUN_DIR/checkpoints/<step>), two
# prompts, 32 new tokens each, with the latent KV cache (kv_lora_rank + qk_rope_head_dim = 576
# values per token per layer), on one TPU VM host (moetext.generate is one process; ~32 GB of
# bf16 params): a v5e-8 (v5e:2x4), v6e-4 (v6e:2x2) or v5p-8. Params in bf16, fsdp over the
# host's chips. Moonlight's own tokenizer is tiktoken, which moetext does not read: TOKENIZER
# (required) is a tokenizer.json or sentencepiece model with its 163840-entry vocabulary.
# Expect on stdout one completion per prompt, on stderr the load, compile and generation times.
# Extra arguments go to moetext.generate (--prompt TEXT, --max_new_tokens N, --jsonl,
# section.key=value). Not run where this script was written (no TPU, no weights).
set -euo pipefail
cd "$(dirname "$0")/../../.."
CHECKPOINT=${CHECKPOINT:-${OUT:-ckpt/moonlight-16b-a3b}}
TOKENIZER=${TOKENIZER:?set TOKENIZER to a tokenizer.json or sentencepiece model for Moonlight}
exec .venv/bin/python -m moetext.generate "${MODEL_CONFIG:-configs/models/moonlight-16b-a3b.yml}" \
  --checkpoint "$CHECKPOINT" --tokenizer "$TOKENIZER" \
  --prompt "The capital of France is" \
  --prompt "def fibonacci(n):" \
  --max_new_tokens 32 --temperature 0 \
  model.param_dtype=bfloat16 sharding.preset=fsdp \
  "$@"
