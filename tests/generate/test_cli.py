"""python -m moetext.generate on a real (briefly trained, scan_layers) run: completions on
stdout, one per prompt; bad requests are one line on stderr and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fake_devices import worker_env
from moetext import config, train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    overrides = [
        "model.scan_layers=true",
        "train.steps=40",
        "train.log_every=20",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.peak_tflops=1",
        "checkpoint.every=40",
        f"train.run_dir={d}",
    ]
    train.run(config.load(TINY, overrides))
    return d


def _generate(*args: str, devices: int | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "moetext.generate", *args]
    env = worker_env(devices) if devices else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


def test_generate_from_a_run_checkpoint(run_dir):
    ckpt = str(run_dir / "checkpoints" / "40")
    r = _generate(
        str(run_dir / "config.yml"),
        "--checkpoint",
        ckpt,
        "--prompt",
        "def fibonacci(",
        "--prompt",
        "The Python",
        "--max_new_tokens",
        "12",
        "--jsonl",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["def fibonacci(", "The Python"]
    for row in rows:
        assert 1 <= len(row["tokens"]) <= 12 and isinstance(row["completion"], str)
    assert "generated" in r.stderr
    # Greedy is deterministic; sampling by seed is too, and a plain-text run prints one line
    # per prompt when the completions hold no newline.
    again = _generate(
        str(run_dir / "config.yml"),
        "--checkpoint",
        ckpt,
        "--prompt",
        "def fibonacci(",
        "--max_new_tokens",
        "12",
        "--jsonl",
    )
    assert json.loads(again.stdout)["tokens"] == rows[0]["tokens"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--top_p", "0"], r"--top_p must be in (0, 1], got 0.0"),
        (
            ["--tokenizer", "/nonexistent/tok.json"],
            "--tokenizer '/nonexistent/tok.json': no such file or directory",
        ),
        (["--max_len", "8"], "more than --max_len 8"),
        (
            ["--template-var", "enable_thinking=false"],
            "--template-var sets chat-template variables: it needs --chat",
        ),
        (
            ["model.emb_dim=32", "model.head_dim=8"],
            "model.emb_dim: the checkpoint has 64, this run 32",
        ),
    ],
)
def test_bad_requests_are_one_line(run_dir, extra, message):
    r = _generate(
        str(run_dir / "config.yml"),
        "--checkpoint",
        str(run_dir / "checkpoints" / "40"),
        "--prompt",
        "hello world",
        "--max_new_tokens",
        "4",
        *extra,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("preset", ["fsdp", "fsdp_ep"])
def test_sharded_cli_decodes_three_prompts_on_four_devices_like_one(run_dir, preset):
    # Under the preset's rules the batch is padded to the 4 batch shards and cut back.
    args = [
        str(run_dir / "config.yml"),
        "--checkpoint",
        str(run_dir / "checkpoints" / "40"),
        "--prompt",
        "def fibonacci(",
        "--prompt",
        "import",
        "--prompt",
        "The Python interpreter",
        "--max_new_tokens",
        "8",
        "--jsonl",
    ]
    one = _generate(*args, devices=1)
    mesh = ["sharding.mesh.fsdp=2", "sharding.mesh.expert=2"] if preset == "fsdp_ep" else []
    four = _generate(*args, f"sharding.preset={preset}", *mesh, devices=4)
    assert one.returncode == 0 and four.returncode == 0, four.stderr[-3000:]
    tokens = [[json.loads(line)["tokens"] for line in r.stdout.splitlines()] for r in (one, four)]
    assert len(tokens[0]) == 3 and tokens[0] == tokens[1]
