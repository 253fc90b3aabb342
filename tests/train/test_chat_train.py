"""Fine-tuning on conversations: the assistant-only loss mask reaches the step, loss_tokens
counts the trained targets, the model learns the answers' form, and generate --chat replies
in it."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np

from moetext import config, train
from moetext.data import chat_pipeline
from moetext.data.batch import target_mask
from moetext.data.prepare import prepare

REPO = Path(__file__).resolve().parents[2]
SFT = REPO / "configs/finetune/tiny-qwen3-moe-sft.yml"


def _chats(path, n):
    """Questions whose answer is a function of the question (the sum), so learning shows."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = (int(x) for x in rng.integers(0, 10, 2))
            msgs = [
                {"role": "user", "content": f"{a}+{b}?"},
                {"role": "assistant", "content": f"{a + b}"},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def test_chat_finetune_trains_on_assistant_tokens_only(tmp_path):
    _chats(tmp_path / "chats.jsonl", 400)
    prepare(
        [str(tmp_path / "chats.jsonl")], "sums", str(tmp_path / "data"), format="chat",
        vocab_size=275, eval_fraction=0.05, quiet=True,
    )  # fmt: skip
    cfg = config.load(
        SFT,  # the shipped tiny SFT recipe, on this data
        [
            "data.name=sums", f"data.data_dir={tmp_path / 'data'}",
            f"train.run_dir={tmp_path / 'run'}", "train.steps=80",
            "train.log_every=1", "train.eval_every=80", "train.progress_bar=false",
            "train.peak_tflops=1.0", "checkpoint.every=80",
        ],
    )  # fmt: skip
    data = chat_pipeline.build(cfg.data, cfg.model.vocab_size, range(8))
    first = [data.next_batch() for _ in range(2)]
    data.close()
    last = train.run(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "run/metrics.jsonl")]
    logged = {r["step"]: r for r in rows if "loss" in r}
    # The step's count of trained targets is the data's: loss mask & same segment & not pad.
    for step, batch in enumerate(first, 1):
        assert logged[step]["loss_tokens"] == int(target_mask(batch).sum())
        # Per conversation: the answer's digits (1-2 tokens) and <|im_end|>: 2-3 targets.
        convs = int(sum(batch["segment_ids"][r].max() for r in range(8)))
        assert 2 * convs <= logged[step]["loss_tokens"] <= 3 * convs
    # The answer is the sum of the question's digits: learnable to well below chance.
    # ln(19 sums) = 2.94 nats would be a model that only knows the answer format; measured
    # 0.91 at step 80.
    assert last["eval_ce_loss"] < 1.2, last
    _chat_answers(tmp_path / "run")


def _chat_answers(run):
    from moetext.generate.__main__ import main

    # Each question its own conversation, batched; greedy replies stop at <|im_end|>.
    pairs = [(0, 0), (3, 5), (7, 9), (9, 2)]
    argv = [str(run / "config.yml"), "--checkpoint", str(run / "checkpoints/80"), "--jsonl",
            "--max_new_tokens", "6"]  # fmt: skip
    for a, b in pairs:
        argv += ["--chat", f"{a}+{b}?"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["prompt"] for r in rows] == [f"{a}+{b}?" for a, b in pairs]
    # Every reply is an answer in the trained form (a number 0..18) ended by the end-of-turn
    # token: only the assistant turns carried loss, so no role header or user text is
    # produced. (Arithmetic itself is not learnt in 80 steps: 2 of 15 sums right, measured.)
    assert all(r["eos"] for r in rows), rows
    assert all(r["completion"].strip() in {str(n) for n in range(19)} for r in rows), rows
