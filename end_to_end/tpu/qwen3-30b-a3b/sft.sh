#!/usr/bin/env bash
# Supervised fine-tuning of Qwen3-30B-A3B on your conversations: convert.sh's OUT (the released
# weights) -> configs/finetune/qwen3-30b-a3b-sft.yml (loss on the assistant turns only, Qwen3's
# own chat template, routers frozen, peak lr 1e-5, 1000 steps of 64 x 4096 tokens) on a v5p-64
# slice (8 TPU VM hosts x 4 chips), pure FSDP. docs/data.md "Conversations" says what is trained.
#
#   STEP=aot      any machine with libtpu, no TPU: compiles this very step (the chat batch with
#                 its loss mask, the frozen routers) for v5p:4x4x2 and prints memory per chip,
#                 FLOPs and collectives; exit 1 if it does not fit in HBM. Run it first.
#   STEP=prepare  then STEP=train (the default runs both): the same command on every host,
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --worker=all --command="cd moetext && \
#       CHATS='/data/chats/*.jsonl' HF_DIR=/data/Qwen3-30B-A3B-Instruct-2507 \
#       CONVERTED=gs://BUCKET/ckpt/qwen3-30b-a3b RUN_DIR=gs://BUCKET/runs/qwen3-30b-a3b-sft \
#       bash end_to_end/tpu/qwen3-30b-a3b/sft.sh"
#     prepare: CHATS (JSONL lines {"messages": [...]} or {"prompt": ..., "completion": ...}, at
#     the same path on every host) -> DATA_DIR/my_chats on the host's own disk, with HF_DIR's
#     tokenizer (tokenizer.json + tokenizer_config.json, whose chat_template is Qwen3's). The
#     same files give every host an identical copy; a re-run with unchanged files does nothing.
#     A bad line fails here, naming its file and line, before anything is written.
#     train: python -m train from CONVERTED (checkpoint.load_params_from: step 0, a fresh
#     optimizer), distributed.initialize=always, checkpoints every 200 steps in RUN_DIR (reached
#     by every host: gs://...). The log prints how many conversations were cut at a turn
#     (data.overlong) and each step's loss_tokens (trained targets).
#   STEP=chat     one host: `moetext.generate --chat` with a checkpoint of the run (CHECKPOINT,
#                 default RUN_DIR/checkpoints/1000), bf16 params, fsdp over the host's chips
#                 (v5p-8, v6e-4 or v5e-8, as decode.sh); one reply per --chat argument, or
#                 `--chat -` for a session on stdin. Then orbax-to-hf (docs/convert.md) serves it
#                 elsewhere.
# Extra arguments go to the command the step runs (train's, for the default): key=value
# overrides, or generate's flags.
# Not run at this size here: the same stages run on the tiny model in CI (end_to_end/cpu/
# run_all.sh, stage f), and the SFT step's AOT compile on the tiny config with data.kind=chat
# (tests/sharding/test_aot.py). `STEP=aot bash sft.sh model.num_layers=2` ran here (2026-11-27,
# libtpu 0.0.50.1): batch inputs tokens, segment_ids, positions, loss_mask [64, 4097], 4.50 GiB
# per chip for 2 of the 48 layers, compile 733 s on a loaded 2-core host; 48 layers not run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
CONFIG=configs/finetune/qwen3-30b-a3b-sft.yml
DATA_DIR=${DATA_DIR:-$HOME/moetext_data}
RUN_DIR=${RUN_DIR:-gs://YOUR_BUCKET/runs/qwen3-30b-a3b-sft}

case "${STEP:-all}" in
  aot)
    exec .venv/bin/python scripts/aot_compile.py "$CONFIG" topology=v5p:4x4x2 \
      sharding.preset=fsdp kernels.gmm_backend="${GMM_BACKEND:-ragged_dot}" "$@"
    ;;
  prepare | train | all) ;;
  chat)
    CHECKPOINT=${CHECKPOINT:-$RUN_DIR/checkpoints/1000}
    (($# > 0)) || set -- --chat "Give me a short introduction to mixture-of-experts models."
    exec .venv/bin/python -m moetext.generate "$RUN_DIR/config.yml" --checkpoint "$CHECKPOINT" \
      --max_new_tokens 256 model.param_dtype=bfloat16 sharding.preset=fsdp "$@"
    ;;
  *) echo "STEP=$STEP: expected aot, prepare, train, all or chat" >&2; exit 2 ;;
esac

if [[ "${STEP:-all}" != train ]]; then
  HF_DIR=${HF_DIR:?set HF_DIR to the Qwen/Qwen3-30B-A3B-Instruct-2507 directory (its tokenizer)}
  CHATS=${CHATS:?set CHATS to your conversation files: a .jsonl path, directory or glob}
  .venv/bin/python -m moetext.data.prepare --format chat --input "$CHATS" --name my_chats \
    --data_dir "$DATA_DIR" --tokenizer "$HF_DIR"
fi
if [[ "${STEP:-all}" != prepare ]]; then
  CONVERTED=${CONVERTED:-${OUT:-ckpt/qwen3-30b-a3b}}
  exec .venv/bin/python -m train "$CONFIG" \
    distributed.initialize=always \
    checkpoint.load_params_from="$CONVERTED" \
    data.data_dir="$DATA_DIR" \
    train.run_dir="$RUN_DIR" \
    train.progress_bar=false \
    sharding.preset=fsdp \
    kernels.gmm_backend="${GMM_BACKEND:-auto}" \
    "$@"
fi
