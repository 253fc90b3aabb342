"""end_to_end/cpu/run_all.sh: the CLIs end to end (prepare -> train -> kill -9 and resume ->
generate -> HF and back -> logits; a tiny HF Qwen3-MoE with a chat tokenizer -> orbax ->
fine-tune on chats -> generate --chat -> HF with its tokenizer; then the
tiny DeepSeek-V3 with MTP through train -> kill -9 and resume -> generate -> HF and back ->
logits), and its checks failing loudly on wrong results.

Budget: the script ~3 min alone on 2 cores (stages a-e measured 102 s; stage f, the HF SFT,
took 311 s on a host loaded ~5x beyond its cores, where the whole script took 1178 s; stage g,
the tiny DeepSeek-V3, 213-246 s on a host loaded ~2-2.5x beyond its cores, where the whole
script took 468 s), more beside other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "end_to_end" / "cpu" / "run_all.sh"
CHECKS = REPO / "end_to_end" / "cpu" / "checks.py"
STAGES = (
    "(a) prepare",
    "(b) train",
    "(c) the same run",
    "(d) generate",
    "(e) convert",
    "(f) fine-tune",
    "(g) tiny-deepseek-v3",
)


@pytest.mark.slow
def test_run_all_passes_every_stage_and_writes_only_under_its_temp_dir(tmp_path):
    tmp, home = tmp_path / "tmp", tmp_path / "home"
    tmp.mkdir()
    home.mkdir()
    # The script's mktemp -d goes under TMPDIR; an empty HOME shows nothing lands in ~ either.
    env = {k: v for k, v in os.environ.items() if k not in ("MOETEXT_DATA_DIR", "KEEP")}
    env.update(TMPDIR=str(tmp), HOME=str(home))
    run = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert "FAILED" not in out
    lines = run.stdout.splitlines()
    for stage in STAGES:
        at = next((i for i, line in enumerate(lines) if line.startswith(f"== {stage}")), None)
        assert at is not None, f"stage {stage} not run:\n{run.stdout}"
        assert any(line.startswith("   ok (") for line in lines[at + 1 :]), stage
    assert run.stdout.count("final params bit-identical") == 2  # (c) Qwen3, (g) DeepSeek-V3
    assert "MTP module included" in run.stdout
    assert lines[-1].startswith("all stages passed in ")
    # Cleaned on exit (KEEP unset), and nothing written outside the work dir.
    assert list(tmp.iterdir()) == [] and list(home.iterdir()) == []


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKS), *args], capture_output=True, text=True, timeout=60
    )


def _metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _steps(n: int, loss=lambda s: 6.0 - s / 10) -> list[dict]:
    return [{"step": s, "loss": loss(s), "grad_norm": 1.0} for s in range(1, n + 1)]


@pytest.mark.parametrize(
    "killed_rows, message",
    [
        # A resume that did not drop the rows past its checkpoint repeats them.
        (_steps(12) + _steps(12)[10:], "steps logged more than once: [11, 12]"),
        # A final loss off by 1e-7 is not bit-identical.
        (_steps(12, lambda s: 6.0 - s / 10 + (1e-7 if s == 12 else 0)), "metrics differ"),
    ],
)
def test_the_resume_check_fails_loudly(tmp_path, killed_rows, message):
    _metrics(tmp_path / "ref", [{"step": 0, "event": "compiled"}, *_steps(12)])
    compiled = [{"step": 0, "event": "compiled"}, {"step": 10, "event": "compiled"}]
    _metrics(tmp_path / "run", compiled + killed_rows)
    got = _check("resumed", str(tmp_path / "run"), str(tmp_path / "ref"), "12", "10")
    assert got.returncode == 1
    assert got.stderr.startswith("FAILED resumed: ") and message in got.stderr, got.stderr


def test_the_wait_check_fails_when_the_run_ends_before_the_kill(tmp_path):
    proc = subprocess.Popen(["true"])  # a run that has already ended
    proc.wait()
    got = _check("wait-checkpoint", str(tmp_path), str(proc.pid), "60")
    assert got.returncode == 1 and "ended before it could be killed" in got.stderr, got.stderr


_HELD = ["0+7?", "3+5?", "6+2?", "9+9?"]  # checks.HELD_OUT
_THINK = "<think>\nsum\n</think>\n\n"  # checks.THINK's block, before every trained answer


@pytest.mark.parametrize(
    "replies, message",
    [
        # A reply that runs on past the end of turn (no <|im_end|>) or talks instead of
        # answering fails; so do a sum without the trained think block and a missing reply.
        ([("7", True), ("8", False), ("8", True), ("18", True)], "no end of turn"),
        ([("7", True), ("8", True), ("user: 6+2?", True), ("18", True)], "and a sum 0..18"),
        ([("7", True), ("8", True), ("8", True), ("19", True)], "and a sum 0..18"),
        ([("7", True), ("8", True), ("8", True)], "replies to"),
    ],
)
def test_the_chat_check_fails_loudly(tmp_path, replies, message):
    rows = [
        {"prompt": q, "completion": _THINK + c, "eos": e}
        for q, (c, e) in zip(_HELD, replies, strict=False)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _check("chatted", str(tmp_path / "c.jsonl"))
    assert got.returncode == 1 and message in got.stderr, got.stderr
    rows = [{"prompt": q, "completion": "7", "eos": True} for q in _HELD]  # no think block
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _check("chatted", str(tmp_path / "c.jsonl"))
    assert got.returncode == 1 and "and a sum 0..18" in got.stderr, got.stderr
    rows = [{"prompt": q, "completion": _THINK + "7", "eos": True} for q in _HELD]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = _check("chatted", str(tmp_path / "c.jsonl"))
    assert ok.returncode == 0 and ok.stdout.endswith(
        "(1 of 4 right; the form is asserted, not the sums)\n"
    )


@pytest.mark.parametrize(
    "final_eval, ok",
    [
        # A model that learnt the form and the sums' frequencies but not the question sits
        # near 2.77 / 12 = 0.231 nats per trained target (measured 0.22-0.26 at step 100,
        # where the replies had the form but the loss had not yet left that plateau): fails.
        (0.223, False),
        (0.018, True),  # measured at step 400, 3 of 4 held-out sums right
    ],
)
def test_the_sft_check_wants_the_sums_learnt(tmp_path, final_eval, ok):
    rows = [{"step": s, "loss": 6.0 - s / 10, "loss_tokens": 100} for s in range(1, 31)]
    rows[-1]["eval_ce_loss"] = final_eval
    _metrics(tmp_path / "sft", rows)
    (tmp_path / "sft" / "checkpoints" / "30").mkdir(parents=True)
    got = _check("sft", str(tmp_path / "sft"), "30", "512")
    if ok:
        assert got.returncode == 0 and "half a question-blind model's" in got.stdout, got.stderr
    else:
        assert got.returncode == 1 and "not learnt" in got.stderr and "0.116" in got.stderr
