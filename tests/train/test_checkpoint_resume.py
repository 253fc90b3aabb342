"""Resume from damaged checkpoints (fall back to the previous complete one, or stop with one
line when none is usable) and from a changed config (harmless fields logged, others refused)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetext import config, program, train
from moetext.checkpoint import Checkpointer, CheckpointError, check_config

# orbax leaves the read coroutines of a failed restore unawaited: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
BASE = [
    "train.progress_bar=false",
    "train.peak_tflops=1.0",
    "train.eval_every=0",
    "train.tensorboard=false",
    "data.kind=synthetic",
    "checkpoint.every=2",
    "checkpoint.async_save=false",
    "train.log_every=1",
]


def _cfg(run_dir, *overrides):
    return config.load(TINY, [*BASE, f"train.run_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real run with checkpoints at steps 2 and 4 (copied by each test, never changed)."""
    run_dir = tmp_path_factory.mktemp("saved")
    train.run(_cfg(run_dir, "train.steps=4"))
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    return run_dir


def test_checkpoint_saves_are_timed_apart_from_the_steps(saved):
    rows = list(map(json.loads, open(saved / "metrics.jsonl")))
    # Saved at 2 and 4: each save's time is a row of its own after the step's, and the step
    # rows do not carry it (the next interval's step time leaves it out).
    saves = [r for r in rows if "checkpoint_time_s" in r]
    assert [r["step"] for r in saves] == [2, 4]
    assert all(r["checkpoint_time_s"] > 0 and "loss" not in r for r in saves)
    assert all(r["step_time_s"] > 0 for r in rows if "loss" in r)


@pytest.fixture
def run_dir(saved, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


def _largest_array_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _delete_array_file(d: Path):
    _largest_array_file(d).unlink()


def _truncate_array_file(d: Path):
    f = _largest_array_file(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def _half_written(d: Path):  # as if killed during the save: orbax's temporary name
    (d / "commit_success.txt").unlink()
    d.rename(d.parent / "4.orbax-checkpoint-tmp")


CORRUPTIONS = {
    "array_file_deleted": _delete_array_file,
    "array_file_truncated": _truncate_array_file,
    "meta_deleted": lambda d: shutil.rmtree(d / "meta"),
    "data_deleted": lambda d: shutil.rmtree(d / "data"),
    "meta_garbage_json": lambda d: (d / "meta/metadata").write_text('{"step": 4, "con'),
    "data_garbage_json": lambda d: (d / "data/process_0-of-1.json").write_text("\x00garbage"),
    "no_commit_marker": lambda d: (d / "commit_success.txt").unlink(),
    "half_written_tmp_dir": _half_written,
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_broken_newest_checkpoint_is_reported_and_the_previous_one_restored(
    run_dir, damage, capsys
):
    CORRUPTIONS[damage](run_dir / "checkpoints/4")
    cfg = _cfg(run_dir, "train.steps=6")
    b = program.build(cfg, abstract=True)  # restore targets only: nothing compiles
    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    try:
        step, state, meta, data_states = ckpt.restore_latest(b.state)
        assert ckpt.all_steps() == [2]  # orbax forgot the broken step: it can be saved again
    finally:
        ckpt.close()
    assert step == 2 == int(state.step) == meta["step"] and data_states[0]["kind"] == "synthetic"
    err = capsys.readouterr().err
    if damage == "half_written_tmp_dir":
        assert f"{run_dir}/checkpoints/4.orbax-checkpoint-tmp: half-written" in err, err
    else:
        (line,) = err.splitlines()[:1]
        assert line.startswith(f"checkpoint: {run_dir}/checkpoints/4: unusable checkpoint ("), err
        assert (run_dir / "checkpoints.broken/4/state").is_dir()  # set aside, not deleted


def test_run_resumes_from_the_previous_checkpoint_and_finishes(run_dir, capsys):
    _delete_array_file(run_dir / "checkpoints/4")
    train.run(_cfg(run_dir, "train.steps=6"))
    err = capsys.readouterr().err
    assert "checkpoints/4: unusable checkpoint (restoring its arrays failed" in err, err
    # The allowed change is logged in one line.
    (line,) = [x for x in err.splitlines() if x.startswith("resume:")]
    assert line.startswith(f"resume: checkpoint {run_dir}/checkpoints/2: "), line
    assert line.endswith("train.steps: 4 -> 6"), line
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    compiled = [r["step"] for r in rows if r.get("event") == "compiled"]
    assert compiled[-1] == 2  # resumed from step 2, then ran to the end
    assert [r["step"] for r in rows if "loss" in r][-4:] == [3, 4, 5, 6]
    assert sorted(int(p) for p in os.listdir(run_dir / "checkpoints") if p.isdigit()) == [2, 4, 6]


def test_no_usable_checkpoint_stops_with_one_line_and_exit_2(run_dir):
    # Both steps broken structurally. (A failed array restore is covered in-process above:
    # orbax's tensorstore callbacks of a failed read can print "Event loop is closed" thread
    # tracebacks of their own, which a subprocess's stderr would then show at random.)
    shutil.rmtree(run_dir / "checkpoints/4/meta")
    shutil.rmtree(run_dir / "checkpoints/2/data")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "train", str(TINY), *BASE, f"train.run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("checkpoint error:")]
    assert f"no usable checkpoint in {run_dir}/checkpoints" in line, line
    assert "step 4: item 'meta' is missing" in line and "step 2: item 'data'" in line, line
    # Nothing was started over them or moved.
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    assert not (run_dir / "checkpoints.broken").exists()


def _delete_all_array_files(d: Path):
    for f in [p for p in (d / "state").rglob("*") if p.is_file() and "/d/" in str(p)]:
        f.unlink()


ARRAY_DAMAGE = {
    "array_file_deleted": _delete_array_file,
    "array_file_truncated": _truncate_array_file,
    "all_array_files_deleted": _delete_all_array_files,
}


@pytest.mark.parametrize("damage", list(ARRAY_DAMAGE))
def test_failed_array_restores_leave_only_moetext_lines_on_stderr(run_dir, damage):
    # Both steps' arrays damaged: two failed orbax restores in one process, then no usable
    # checkpoint. Orbax's and tensorstore's own reports (absl warnings, 'Event loop is closed'
    # callback tracebacks) are quieted at their source (checkpoint/orbax_noise.py).
    for step in ("2", "4"):
        ARRAY_DAMAGE[damage](run_dir / "checkpoints" / step)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "train", str(TINY), *BASE, f"train.run_dir={run_dir}"]
    out = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    assert [x.split(":")[0] for x in lines] == [
        "checkpoint",  # step 4: unusable checkpoint (...); trying the previous one
        "checkpoint",  # step 2: the same
        "checkpoint error",  # no usable checkpoint in ...
    ], out.stderr


@pytest.mark.parametrize(
    ("override", "field", "old", "new"),
    [
        ("model.emb_dim=32", "model.emb_dim", "64", "32"),
        ("data.seed=7", "data.seed", "0", "7"),
        # The data position is per row of the global batch, in rows of seq_len + 1 tokens:
        # another batch size or length would read another stream (resume another slice with
        # the same global batch instead; README).
        ("data.global_batch_size=4", "data.global_batch_size", "8", "4"),
        ("data.seq_len=32", "data.seq_len", "64", "32"),
    ],
)
def test_resume_with_a_changed_shape_or_data_field_is_refused(run_dir, override, field, old, new):
    with pytest.raises(CheckpointError) as e:
        train.run(_cfg(run_dir, "train.steps=6", override))
    msg = str(e.value)
    assert f"{field}: {old} -> {new}" in msg and f"{run_dir}/checkpoints/4" in msg, msg
    assert "train.steps" not in msg  # allowed changes are not blamed
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert sum(r.get("event") == "compiled" for r in rows) == 1  # refused before compiling


def test_checkpoint_without_a_saved_config_resumes_with_a_warning_and_safe_changes_pass():
    cfg = config.load(TINY, ["train.steps=7", "optim.clip_norm=0.5", "sharding.mesh={fsdp: 1}"])
    (warning,) = check_config(None, cfg, "checkpoint x/4")
    assert "no saved config (an older checkpoint)" in warning
    saved = config.to_dict(config.load(TINY))
    del saved["train"]["tensorboard"]  # a field added since: compared with its default
    assert check_config(saved, cfg, "c") == [
        "optim.clip_norm: 1.0 -> 0.5",
        "sharding.mesh: {} -> {'fsdp': 1}",
        "train.steps: 300 -> 7",
    ]
    off = config.load(TINY, ["optim.clip_norm=null"])
    with pytest.raises(CheckpointError, match=r"optim.clip_norm: 1.0 -> None"):
        check_config(saved, off, "c")
