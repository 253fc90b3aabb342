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


def test_metric_panels_and_an_unlogged_metric(tmp_path):
    # --metric draws the named keys (one panel each) instead of the four default panels.
    runs = []
    for name, vio in (("fast", 0.1), ("slow", 0.9)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 3.0, "max_vio/layer_1": vio + 1 / s} for s in range(1, 6)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    out = tmp_path / "vio.png"
    assert (
        plot.main([*runs, "--metric", "max_vio/layer_1", "--metric", "loss", "--out", str(out)])
        == 0
    )
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    series = plot.read_series(runs[1], ["max_vio/layer_1"])
    assert series["max_vio/layer_1"] == ([1, 2, 3, 4, 5], [0.9 + 1 / s for s in range(1, 6)])
    # A name no run logged: one line naming it and what the runs do log; no PNG.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetext.plot",
            *runs,
            "--metric",
            "loss",
            "--metric",
            "max_vio/layer_7",
            "--out",
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "max_vio/layer_7" in proc.stderr, proc.stderr
    assert "max_vio/layer_1" in proc.stderr
    assert not (tmp_path / "x.png").exists()
