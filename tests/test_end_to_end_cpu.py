"""end_to_end/cpu/run_all.sh: the CLIs end to end (prepare -> train -> kill -9 and resume ->
generate -> HF and back -> logits -> fine-tune on chats -> generate --chat -> HF; then the
tiny DeepSeek-V3 with MTP through train -> kill -9 and resume -> generate -> HF and back ->
logits), and its checks failing loudly on wrong results.

Budget: the script ~3 min alone on 2 cores (stages a-e measured 102 s; stage f, the SFT, took
289 s on a host loaded ~6x beyond its cores; stage g, the tiny DeepSeek-V3, 213-246 s on a host
loaded ~2-2.5x beyond its cores, where the whole script took 468 s), more beside other tests.
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


@pytest.mark.parametrize(
    "replies, message",
    [
        # A reply that runs on past the end of turn (no <|im_end|>) or talks instead of
        # answering fails; so does a missing reply.
        ([("7", True), ("8", False), ("8", True), ("18", True)], "no end of turn"),
        ([("7", True), ("8", True), ("user: 6+2?", True), ("18", True)], "not a sum 0..18"),
        ([("7", True), ("8", True), ("8", True)], "replies to"),
    ],
)
def test_the_chat_check_fails_loudly(tmp_path, replies, message):
    rows = [
        {"prompt": q, "completion": c, "eos": e} for q, (c, e) in zip(_HELD, replies, strict=False)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _check("chatted", str(tmp_path / "c.jsonl"))
    assert got.returncode == 1 and message in got.stderr, got.stderr
    rows = [{"prompt": q, "completion": "5", "eos": True} for q in _HELD]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = _check("chatted", str(tmp_path / "c.jsonl"))
    assert ok.returncode == 0 and ok.stdout.endswith(
        "(0 of 4 right; the form is asserted, not the sums)\n"
    )
