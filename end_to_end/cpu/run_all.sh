#!/usr/bin/env bash
# End to end on CPU, through the real CLIs, asserting at every stage (end_to_end/cpu/checks.py):
#   (a) prepare the embedded python_docs corpus and its tokenizer
#   (b) train tiny-qwen3-moe for $STEPS steps, uninterrupted: the reference
#   (c) the same command again, kill -9 mid-run (after a checkpoint), re-run it: it resumes, and
#       metrics and final params equal the reference's bit for bit
#   (d) generate from the final checkpoint
#   (e) orbax -> HF safetensors -> orbax -> HF: bit-exact; HF model logits == run model logits
#   (f) a tiny Qwen3-MoE Hugging Face checkpoint with a tokenizer.json and a chat template
#       (tests/fixtures/hf/qwen3_chat) -> hf-to-orbax (logits == transformers'), fine-tuned on
#       generated "a+b?" conversations (assistant-only loss, its own tokenizer and template)
#       until it answers from the question, held-out questions answered with generate --chat,
#       exported to HF with its tokenizer files and logits compared
#   (g) tiny-deepseek-v3 (MLA, MTP on) on (a)'s corpus: (b) and (c) in 20 steps (mtp_loss asserted),
#       (d), and (e) with the MTP module through the round trip
# ~2.5-3 min on 2 CPU cores (measured 77-102 s for (a)-(e) on a shared machine). Writes only under a
# `mktemp -d` directory (data, runs, conversions, TMPDIR, caches), removed on exit unless KEEP=1:
#   bash end_to_end/cpu/run_all.sh    # KEEP=1 keeps the work dir; STEPS=N (a multiple of 20)
#   STAGES=f bash end_to_end/cpu/run_all.sh    # some stages: (b) needs (a), (c) (b), (d) and
#                                              # (e) (c), (g) (a); (f) stands alone
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY="$REPO/.venv/bin/python"
CHECKS="$REPO/end_to_end/cpu/checks.py"
CONFIG="$REPO/configs/models/tiny-qwen3-moe.yml"
[[ -x "$PY" ]] || { echo "FAILED: no $PY (run: bash setup.sh)" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/moetext-e2e-cpu.XXXXXX")
TRAIN_PID=""
cleanup() {
  local rc=$?
  # A failure while the killed-to-be run is still going: end it before removing its dir.
  if [[ -n "$TRAIN_PID" ]]; then kill -9 "$TRAIN_PID" 2>/dev/null || true; fi
  if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
mkdir -p "$WORK/tmp" "$WORK/cache"
# Everything the tools write goes under $WORK: the corpus (data.data_dir is also passed
# explicitly), tempfile's scratch (corpus preparation, conversion staging), any XDG cache.
# The CLIs' compilation cache ("auto") lands in $XDG_CACHE_HOME too: the resumed runs load
# the programs the first runs compiled.
export TMPDIR="$WORK/tmp" XDG_CACHE_HOME="$WORK/cache" MOETEXT_DATA_DIR="$WORK/data"
unset MOETEXT_COMPILATION_CACHE_DIR
export PYTHONDONTWRITEBYTECODE=1 JAX_PLATFORMS=cpu
unset XLA_FLAGS  # one CPU device, as the tiny config expects; a forced count changes the mesh

# STEPS long enough that the killed run is still going after its first checkpoint (every 10).
STEPS=${STEPS:-60}
STAGES=${STAGES:-abcdefg}
[[ $STAGES =~ ^[a-g]+$ ]] || { echo "FAILED: STAGES=$STAGES: want letters a-g" >&2; exit 1; }
want() { [[ $STAGES == *$1* ]]; }
for need in b:a c:b d:c e:c g:a; do
  if want "${need%:*}" && ! want "${need#*:}"; then
    echo "FAILED: STAGES=$STAGES: stage (${need%:*}) needs stage (${need#*:})" >&2; exit 1
  fi
done
((STEPS >= 40 && STEPS % 20 == 0)) \
  || { echo "FAILED: STEPS=$STEPS must be a multiple of 20 (eval_every), at least 40" >&2; exit 1; }
VOCAB=512  # tiny-qwen3-moe's model.vocab_size
TRAIN=("$PY" -m train "$CONFIG"
  "data.data_dir=$WORK/data" "train.steps=$STEPS" "train.log_every=1" "train.eval_every=20"
  "checkpoint.every=10" "checkpoint.async_save=true" "train.progress_bar=false"
  "train.peak_tflops=1.0")  # a given MFU peak: skips measuring one at start

T0=$SECONDS
STAGE_T0=$SECONDS
stage() { STAGE=$1; STAGE_T0=$SECONDS; echo; echo "== $1"; }
passed() { echo "   ok ($((SECONDS - STAGE_T0)) s): $*"; }
fail() { echo "FAILED $STAGE: $*" >&2; exit 1; }
# run LOG CMD...: CMD with stdout+stderr to LOG; on a non-zero exit show LOG's tail and fail.
run() {
  local log=$1 rc=0; shift
  "$@" >"$log" 2>&1 || rc=$?
  [[ $rc == 0 ]] || { tail -n 30 "$log" >&2; fail "exit $rc from: $*"; }
}

if want a; then
stage "(a) prepare the embedded corpus into $WORK/data"
out=$("$PY" "$CHECKS" prepare "$WORK/data" "$VOCAB") || fail "see above"
passed "$out"
fi

if want b; then
stage "(b) train tiny-qwen3-moe for $STEPS steps, uninterrupted (the reference)"
run "$WORK/ref.log" "${TRAIN[@]}" "train.run_dir=$WORK/ref"
grep -q "preparing" "$WORK/ref.log" && fail "training prepared the corpus again (not stage a's)"
out=$("$PY" "$CHECKS" trained "$WORK/ref" "$STEPS") || fail "see above"
passed "$out"
fi

if want c; then
stage "(c) the same run, kill -9 mid-run, then the same command again"
"${TRAIN[@]}" "train.run_dir=$WORK/run" >"$WORK/killed.log" 2>&1 &
TRAIN_PID=$!
out=$("$PY" "$CHECKS" wait-checkpoint "$WORK/run" "$TRAIN_PID" "$STEPS") \
  || { tail -n 30 "$WORK/killed.log" >&2; fail "see above"; }
kill -9 "$TRAIN_PID"
rc=0; wait "$TRAIN_PID" || rc=$?
TRAIN_PID=""
[[ $rc == 137 ]] || fail "the killed run exited $rc, not 137 (SIGKILL)"
echo "   killed with SIGKILL at: $out"
from=$("$PY" "$CHECKS" killed "$WORK/run" "$STEPS") || fail "see above"
run "$WORK/resume.log" "${TRAIN[@]}" "train.run_dir=$WORK/run"
out=$("$PY" "$CHECKS" resumed "$WORK/run" "$WORK/ref" "$STEPS" "$from") || fail "see above"
passed "$out"
fi

CKPT="$WORK/run/checkpoints/$STEPS"
if want d; then
# Sampled (seeded): after 60 steps greedy decoding of this toy repeats its likeliest token,
# a newline.
stage "(d) generate from $CKPT"
rc=0
"$PY" -m moetext.generate "$WORK/run/config.yml" --checkpoint "$CKPT" --jsonl \
  --prompt "def fibonacci(" --prompt "The with statement" --max_new_tokens 20 \
  --temperature 0.7 --seed 0 \
  >"$WORK/generated.jsonl" 2>"$WORK/generate.log" || rc=$?
[[ $rc == 0 ]] || { tail -n 30 "$WORK/generate.log" >&2; fail "moetext.generate exited $rc"; }
out=$("$PY" "$CHECKS" generated "$WORK/generated.jsonl" 2) || fail "see above"
passed "$out"
fi

if want e; then
stage "(e) convert: orbax -> HF safetensors -> orbax -> HF, then logits"
run "$WORK/to_hf.log" "$PY" -m moetext.convert orbax-to-hf --checkpoint "$CKPT" --out "$WORK/hf"
run "$WORK/to_orbax.log" "$PY" -m moetext.convert hf-to-orbax --hf "$WORK/hf" --out "$WORK/orbax"
run "$WORK/to_hf2.log" "$PY" -m moetext.convert orbax-to-hf --checkpoint "$WORK/orbax" \
  --out "$WORK/hf2"
out=$("$PY" "$CHECKS" hf-roundtrip "$WORK/hf" "$WORK/orbax" "$WORK/hf2" "$CKPT") \
  || fail "see above"
echo "   $out"
out=$("$PY" "$CHECKS" logits "$WORK/run/config.yml" "$CKPT" "$WORK/hf") || fail "see above"
passed "$out"
fi

# Fine-tuning a Hugging Face checkpoint: tests/fixtures/hf/qwen3_chat is a tiny Qwen3-MoE as
# transformers writes it (fresh random weights, bfloat16 safetensors, config.json) with a BPE
# tokenizer.json and Qwen3's chat template (scripts/make_hf_fixture.py). It is converted, its
# logits checked against transformers', fine-tuned with assistant-only loss on "a+b?" chats
# prepared with its own tokenizer and template, asked held-out questions with generate --chat,
# and exported back to HF with its tokenizer files.
HF_BASE="$REPO/tests/fixtures/hf/qwen3_chat"
SFT_STEPS=400
if want f; then
stage "(f) fine-tune $HF_BASE via hf-to-orbax on conversations ($SFT_STEPS steps), chat, export"
run "$WORK/base_to_orbax.log" "$PY" -m moetext.convert hf-to-orbax --hf "$HF_BASE" \
  --out "$WORK/base" --dtype float32
out=$("$PY" "$CHECKS" hf-logits "$WORK/base" "$HF_BASE") || fail "see above"
echo "   $out"
out=$("$PY" "$CHECKS" chats "$WORK/chats" 400) || fail "see above"
echo "   $out"
run "$WORK/prepare_chats.log" "$PY" -m moetext.data.prepare --format chat \
  --input "$WORK/chats/chats.jsonl" --name sums --data_dir "$WORK/data" \
  --tokenizer "$HF_BASE" --eval_fraction 0.05
# The recipe's model is tiny-qwen3-moe's shape; the checkpoint's vocabulary is the fixture's.
HF_VOCAB=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
  "$HF_BASE/config.json")
run "$WORK/sft.log" "$PY" -m train "$REPO/configs/finetune/tiny-qwen3-moe-sft.yml" \
  "checkpoint.load_params_from=$WORK/base" "model.vocab_size=$HF_VOCAB" "data.name=sums" \
  "data.data_dir=$WORK/data" "train.run_dir=$WORK/sft" "train.steps=$SFT_STEPS" \
  "train.log_every=1" "train.eval_every=100" "checkpoint.every=$SFT_STEPS" \
  "train.progress_bar=false" "train.peak_tflops=1.0"
grep -q "^params from $WORK/base" "$WORK/sft.log" || fail "the fine-tune did not start from it"
out=$("$PY" "$CHECKS" sft "$WORK/sft" "$SFT_STEPS" $((8 * 64))) || fail "see above"  # batch x seq_len
echo "   $out"
SFT_CKPT="$WORK/sft/checkpoints/$SFT_STEPS"
mapfile -t HELD < "$WORK/chats/held_out.txt"
CHAT=(); for q in "${HELD[@]}"; do CHAT+=(--chat "$q"); done
rc=0
# 12 tokens: the think block (9), a sum (1-2), the end of turn.
"$PY" -m moetext.generate "$WORK/sft/config.yml" --checkpoint "$SFT_CKPT" --jsonl \
  "${CHAT[@]}" --max_new_tokens 12 >"$WORK/chatted.jsonl" 2>"$WORK/chat.log" || rc=$?
[[ $rc == 0 ]] || { tail -n 30 "$WORK/chat.log" >&2; fail "moetext.generate --chat exited $rc"; }
out=$("$PY" "$CHECKS" chatted "$WORK/chatted.jsonl") || fail "see above"
echo "   $out"
run "$WORK/sft_to_hf.log" "$PY" -m moetext.convert orbax-to-hf --checkpoint "$SFT_CKPT" \
  --out "$WORK/sft_hf"
out=$("$PY" "$CHECKS" exported-tokenizer "$WORK/sft_hf" "$HF_BASE") || fail "see above"
echo "   $out"
out=$("$PY" "$CHECKS" logits "$WORK/sft/config.yml" "$SFT_CKPT" "$WORK/sft_hf") \
  || fail "see above"
passed "$out"
fi

# The second model family: DeepSeek-V3's architecture (MLA, dense first layer, shared expert,
# group-limited sigmoid routing, multi-token prediction) on stage (a)'s corpus, through (b)-(e)'s
# checks with fewer steps. MTP is on: mtp_loss is asserted on every step and its module goes
# through the HF round trip (checkpoints carry it; transformers' model ignores it).
DS_STEPS=20
DS_TRAIN=("$PY" -m train "$REPO/configs/models/tiny-deepseek-v3.yml"
  "data.data_dir=$WORK/data" "train.steps=$DS_STEPS" "train.log_every=1" "train.eval_every=10"
  "checkpoint.every=5" "checkpoint.async_save=true" "train.progress_bar=false"
  "train.peak_tflops=1.0")
if want g; then
stage "(g) tiny-deepseek-v3 (MTP on): train, kill -9 and resume, generate, HF and back"
run "$WORK/ds_ref.log" "${DS_TRAIN[@]}" "train.run_dir=$WORK/ds_ref"
grep -q "preparing" "$WORK/ds_ref.log" && fail "training prepared the corpus again (not stage a's)"
out=$("$PY" "$CHECKS" trained "$WORK/ds_ref" "$DS_STEPS" --mtp) || fail "see above"
echo "   reference: $out"
"${DS_TRAIN[@]}" "train.run_dir=$WORK/ds_run" >"$WORK/ds_killed.log" 2>&1 &
TRAIN_PID=$!
out=$("$PY" "$CHECKS" wait-checkpoint "$WORK/ds_run" "$TRAIN_PID" "$DS_STEPS") \
  || { tail -n 30 "$WORK/ds_killed.log" >&2; fail "see above"; }
kill -9 "$TRAIN_PID"
rc=0; wait "$TRAIN_PID" || rc=$?
TRAIN_PID=""
[[ $rc == 137 ]] || fail "the killed run exited $rc, not 137 (SIGKILL)"
echo "   killed with SIGKILL at: $out"
from=$("$PY" "$CHECKS" killed "$WORK/ds_run" "$DS_STEPS") || fail "see above"
run "$WORK/ds_resume.log" "${DS_TRAIN[@]}" "train.run_dir=$WORK/ds_run"
out=$("$PY" "$CHECKS" resumed "$WORK/ds_run" "$WORK/ds_ref" "$DS_STEPS" "$from") \
  || fail "see above"
echo "   $out"
DS_CKPT="$WORK/ds_run/checkpoints/$DS_STEPS"
rc=0
"$PY" -m moetext.generate "$WORK/ds_run/config.yml" --checkpoint "$DS_CKPT" --jsonl \
  --prompt "def fibonacci(" --prompt "The with statement" --max_new_tokens 20 \
  --temperature 0.7 --seed 0 \
  >"$WORK/ds_generated.jsonl" 2>"$WORK/ds_generate.log" || rc=$?
[[ $rc == 0 ]] || { tail -n 30 "$WORK/ds_generate.log" >&2; fail "moetext.generate exited $rc"; }
out=$("$PY" "$CHECKS" generated "$WORK/ds_generated.jsonl" 2) || fail "see above"
echo "   $out"
run "$WORK/ds_to_hf.log" "$PY" -m moetext.convert orbax-to-hf --checkpoint "$DS_CKPT" \
  --out "$WORK/ds_hf"
run "$WORK/ds_to_orbax.log" "$PY" -m moetext.convert hf-to-orbax --hf "$WORK/ds_hf" \
  --out "$WORK/ds_orbax"
run "$WORK/ds_to_hf2.log" "$PY" -m moetext.convert orbax-to-hf --checkpoint "$WORK/ds_orbax" \
  --out "$WORK/ds_hf2"
out=$("$PY" "$CHECKS" hf-roundtrip "$WORK/ds_hf" "$WORK/ds_orbax" "$WORK/ds_hf2" "$DS_CKPT" \
  --mtp) || fail "see above"
echo "   $out"
out=$("$PY" "$CHECKS" logits "$WORK/ds_run/config.yml" "$DS_CKPT" "$WORK/ds_hf") \
  || fail "see above"
passed "$out"
fi

echo
echo "all stages passed in $((SECONDS - T0)) s"
