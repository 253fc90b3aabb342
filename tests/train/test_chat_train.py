"""Fine-tuning on conversations: the assistant-only loss mask reaches the step, loss_tokens
counts the trained targets, the model learns the answers' form, and generate --chat replies
in it."""

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
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
    _chat_session_on_stdin(tmp_path / "run", tmp_path / "run/checkpoints/80")


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


def _chat_session_on_stdin(run, step_dir):
    """`generate --chat -` as a user types it: a turn, its reply on stdout before the next
    turn is typed (stdin stays open), a blank line (ignored), another turn, then end of input.
    Each reply equals the in-process greedy reply to the whole conversation so far (the
    earlier turns and replies kept, as the template renders them)."""
    from moetext.generate import batch_shards, chat, load
    from moetext.program import make_plan

    ckpt = str(step_dir)
    cmd = [sys.executable, "-m", "moetext.generate", str(run / "config.yml"),
           "--checkpoint", ckpt, "--chat", "-", "--max_new_tokens", "6"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    log = run / "session.log"  # stderr to a file: a full pipe nobody reads would block it
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env=env, cwd=run,
        )  # fmt: skip
    watchdog = threading.Timer(300, proc.kill)  # a reply that never comes fails, not hangs
    watchdog.start()
    try:
        assert proc.stdin is not None and proc.stdout is not None
        replies = []
        for typed in ("3+5?\n", "\n7+9?\n"):
            proc.stdin.write(typed)
            proc.stdin.flush()
            replies.append(proc.stdout.readline())  # printed while stdin is still open
        proc.stdin.close()  # end of input (Ctrl-D) ends the session
        rest = proc.stdout.read()
        proc.wait()
    finally:
        watchdog.cancel()
    err = log.read_text()
    assert proc.returncode == 0 and rest == "", (proc.returncode, rest, err[-2000:])
    assert all(r.endswith("\n") for r in replies), (replies, err[-2000:])

    cfg, model, tok = load(run / "config.yml", ckpt)
    template = chat.template_for(tok, cfg.data.chat_template)
    stop = chat.stop_ids(template, tok, ckpt, str(run / "tokenizer"))
    plan = make_plan(cfg)
    kw = dict(stop=stop, max_new_tokens=6, max_len=cfg.data.seq_len,
              batch_multiple=batch_shards(plan))  # fmt: skip
    conv: list[dict[str, str]] = []
    with plan.rules():
        for user, got in zip(("3+5?", "7+9?"), replies, strict=True):
            conv.append({"role": "user", "content": user})
            (want,), _ = chat.reply(model, tok, template, [conv], **kw)
            assert got == want + "\n", (conv, got, want)
            conv.append({"role": "assistant", "content": want})
    # The history matters to these replies: on a tiny SFT model fine-tuned from a pretraining
    # run on a+b chats, the second turn's greedy reply was "1" after the first exchange and
    # "11" alone (measured).
