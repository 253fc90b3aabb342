"""`python -m moetext.plot`: curves of several runs into one PNG; bad input exits 2."""

import json
import subprocess
import sys

import pytest

from moetext import plot


def _run_dir(path, scale):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "event": "compiled", "compile_s": 1.0}) + "\n")
        for step in range(1, 11):
            row = {"step": step, "loss": scale * 6 / step, "lr": 1e-3, "tokens_per_s": 4000.0}
            if step % 5 == 0:
                row["eval_loss"] = scale * 7 / step
            f.write(json.dumps(row) + "\n")
    return path


def test_two_runs_make_one_png(tmp_path):
    a, b = _run_dir(tmp_path / "a", 1.0), _run_dir(tmp_path / "b", 1.2)
    out = tmp_path / "curves.png"
    assert plot.main([str(a), str(b), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


@pytest.mark.parametrize("make", ["missing", "empty_dir", "no_steps"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "no_steps":
        (run / "metrics.jsonl").write_text('{"step": 0, "event": "compiled"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "moetext.plot", str(run), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(run) in proc.stderr, proc.stderr
    assert not (tmp_path / "x.png").exists()
