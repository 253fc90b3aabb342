"""Long runs: a real SIGTERM/SIGINT checkpoints and exits 0 (then the run resumes there); kill -9
loses only the steps since the last checkpoint; a non-finite loss stops the run (or is skipped)
without ever writing a non-finite checkpoint; run-dir and checkpoint-write failures are one line."""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_devices import running, xla_flags
from moetext import config, program, train
from moetext.train import rundir
from moetext.train.nonfinite import NonFiniteError
from moetext.train.preemption import Preemption

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
QUIET = ["train.progress_bar=false", "train.peak_tflops=1.0", "train.eval_every=0"]
# lr 1e30 from the first step: the params blow up after step 1 and the gradient of step 2 is NaN.
BLOW_UP = ["optim.learning_rate=1e30", "optim.warmup_steps=0"]


def _cli(run_dir, *overrides) -> list[str]:
    return [
        sys.executable,
        "-m",
        "train",
        str(TINY),
        *QUIET,
        f"train.run_dir={run_dir}",
        *overrides,
    ]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src")}


def _rows(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _steps(run_dir) -> list[int]:
    return [r["step"] for r in _rows(run_dir) if "loss" in r]


def _checkpoints(run_dir) -> list[int]:
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


def _signal_after_steps(tmp_path, sig: int, min_steps: int = 3):
    """Starts a long run, sends `sig` once `min_steps` rows are logged; (process output, the
    newest logged step when the signal went out)."""
    cmd = _cli(tmp_path, "train.steps=10000", "train.log_every=1", "checkpoint.every=1000")
    with running(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as proc:
        deadline = time.monotonic() + 120
        while len(_steps(tmp_path)) < min_steps:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "no training steps logged in time"
            time.sleep(0.2)
        seen = _steps(tmp_path)[-1]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    return out, seen


def test_sigterm_checkpoints_the_current_step_then_the_same_command_resumes(tmp_path):
    out, seen = _signal_after_steps(tmp_path, signal.SIGTERM)
    (saved,) = _checkpoints(tmp_path)  # not a checkpoint.every multiple
    assert saved >= seen
    assert f"saved checkpoint {tmp_path / 'checkpoints' / str(saved)}" in out
    assert "re-run the same command to resume" in out
    assert _steps(tmp_path)[-1] == saved  # the stopping step is logged
    # The same command (here with a nearer end) resumes from that checkpoint.
    more = subprocess.run(
        _cli(tmp_path, f"train.steps={saved + 3}", "train.log_every=1", "checkpoint.every=1000"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert more.returncode == 0, more.stderr[-3000:]
    compiled = [r["step"] for r in _rows(tmp_path) if r.get("event") == "compiled"]
    assert compiled[-1] == saved  # the second process started at the checkpoint
    assert [s for s in _steps(tmp_path) if s > saved] == [saved + 1, saved + 2, saved + 3]
    assert _checkpoints(tmp_path) == [saved, saved + 3]


def test_sigint_checkpoints_and_exits_zero(tmp_path):
    out, seen = _signal_after_steps(tmp_path, signal.SIGINT)
    (saved,) = _checkpoints(tmp_path)
    assert saved >= seen and "SIGINT: stopped after step" in out


def test_ctrl_c_on_one_of_two_processes_stops_both_at_the_same_step(tmp_path):
    # No preemption service involved (that is SIGTERM's path): the processes OR their flags at
    # the log steps. Each process has one CPU device; they join through jax.distributed.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env(), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    run = tmp_path / "run"
    same = [
        "train.steps=10000",
        "train.log_every=2",
        "checkpoint.every=1000",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
    ]
    with ExitStack() as stack:
        procs = [
            stack.enter_context(
                running(
                    _cli(run, *same, f"distributed.process_id={i}"),
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 240
        while len(_steps(run)) < 2:
            assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
            assert time.monotonic() < deadline, "no training steps logged in time"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    (saved,) = _checkpoints(run)
    assert saved % 2 == 0  # agreed at a log step
    assert f"a signal on another process: stopped after step {saved}" in outs[0]


def _kill_during_async_save(run_dir, cli: list[str], after_step: int) -> int:
    """Starts `cli`, SIGKILLs it while orbax writes the first async save of a step past
    `after_step` (its <step>.orbax-checkpoint-tmp directory exists); returns that step."""
    ckpts = Path(run_dir) / "checkpoints"
    with running(
        cli, cwd=run_dir, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proc:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the run ended before a save could be interrupted"
            assert time.monotonic() < deadline, "no checkpoint save seen in time"
            names = os.listdir(ckpts) if ckpts.exists() else []
            saving = [int(n.split(".")[0]) for n in names if n.endswith(".orbax-checkpoint-tmp")]
            if saving and max(saving) > after_step:
                proc.kill()  # SIGKILL: no handler runs, no save is finished
                proc.wait(timeout=30)
                return max(saving)
            time.sleep(0.001)  # a save of the tiny state takes ~300 ms on 2 cores


# sigmoid_topk with the aux-loss-free bias moving every step: the bias (ModelState) must come
# back from the checkpoint exactly, or the resumed steps route differently.
BIASED = ["moe.router=sigmoid_topk", "moe.bias_update_rate=0.01"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,extra",
    [("synthetic", []), ("tfds", []), ("synthetic", BIASED)],
    ids=["synthetic", "tfds", "synthetic_bias"],
)
def test_kill_9_during_an_async_save_then_rerun_matches_an_uninterrupted_run(tmp_path, kind, extra):
    same = [
        *extra,
        f"data.kind={kind}",
        "train.steps=16",
        "train.log_every=1",
        "train.eval_every=4",
        "checkpoint.every=4",
        "checkpoint.async_save=true",
    ]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for d in (straight, killed):
        d.mkdir()
    ref = subprocess.run(
        [*_cli(straight, *same), "checkpoint.enabled=false"],
        cwd=straight,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    interrupted = _kill_during_async_save(killed, _cli(killed, *same), after_step=4)
    # The step being saved never became a checkpoint; the ones before it are complete.
    assert (killed / "checkpoints" / f"{interrupted}.orbax-checkpoint-tmp").exists()
    complete = _checkpoints(killed)
    assert complete and max(complete) == interrupted - 4, (interrupted, complete)

    again = subprocess.run(
        _cli(killed, *same), cwd=killed, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr, again.stderr[-3000:]
    compiled = [r["step"] for r in _rows(killed) if r.get("event") == "compiled"]
    assert compiled == [0, max(complete)]  # lost only the steps after the last checkpoint
    # One run's worth of rows (those past the checkpoint were dropped on resume), and the same
    # numbers bit for bit: same compiled program, optimizer state and data position.
    keys = ("loss", "grad_norm", "eval_loss")
    if extra:  # the bias each step routed with (logged before its update), every MoE layer
        keys += tuple(sorted(k for k in _rows(straight)[-1] if k.startswith("selection_bias")))
        first, last = (r for r in (_rows(straight)[1], _rows(straight)[-1]))
        assert first["selection_bias_max/layer_0"] != last["selection_bias_max/layer_0"]
    want = {r["step"]: [r.get(k) for k in keys] for r in _rows(straight) if "loss" in r}
    got = [(r["step"], [r.get(k) for k in keys]) for r in _rows(killed) if "loss" in r]
    assert [s for s, _ in got] == list(range(1, 17))
    assert dict(got) == want
    assert sum(v[2] is not None for v in want.values()) == 4  # eval at 4, 8, 12, 16
    assert _checkpoints(killed)[-1] == 16


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals: main thread"
)
def test_second_sigint_raises_and_handlers_are_restored():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    term_before = signal.getsignal(signal.SIGTERM)
    try:
        p = Preemption(sync_every=10)
        assert not p.should_stop(1)
        signal.raise_signal(signal.SIGINT)
        assert p.received == "SIGINT" and p.should_stop(2)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the second one is not caught
        p.close()
        assert signal.getsignal(signal.SIGTERM) is term_before
        p = Preemption(sync_every=10)
        p.close()  # without a signal: close() restores as well
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is term_before
    finally:
        signal.signal(signal.SIGINT, before)


def test_nonfinite_loss_stops_with_one_line_and_no_bad_checkpoint(tmp_path):
    run = subprocess.run(
        _cli(tmp_path, "train.steps=20", "train.log_every=5", "checkpoint.every=1", *BLOW_UP),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("error:")]
    # Step 1 is finite (its update is what blows up); step 2's gradient is NaN.
    assert "non-finite" in line and "at step 2" in line, line
    assert f"last good checkpoint: {tmp_path / 'checkpoints' / '1'}" in line, line
    assert _checkpoints(tmp_path) == [1]


def test_skip_nonfinite_steps_skips_then_stops_after_n_in_a_row(tmp_path):
    cfg = config.load(
        TINY,
        [
            *QUIET,
            f"train.run_dir={tmp_path}",
            "train.steps=20",
            "train.log_every=5",
            "checkpoint.every=1",
            "checkpoint.keep=20",
            "train.skip_nonfinite_steps=3",
            *BLOW_UP,
        ],
    )
    with pytest.raises(NonFiniteError, match="4 consecutive steps .* the last at step 5"):
        train.run(cfg)
    skipped = [r["step"] for r in _rows(tmp_path) if r.get("event") == "skipped_nonfinite"]
    assert skipped == [2, 3, 4, 5]
    # Skipped steps keep the (finite) params of step 1; the step after the 4th skip is not saved.
    assert _checkpoints(tmp_path) == [1, 2, 3, 4]


def test_skipped_step_keeps_params_and_optimizer_state():
    cfg = config.load(TINY, ["data.kind=synthetic", "train.skip_nonfinite_steps=1"])
    b = program.build(cfg)
    step = program.jit_train_step(b)
    batch = {k: np.zeros((8, cfg.data.seq_len + 1), np.int32) for k in ("tokens", "positions")}
    batch["segment_ids"] = np.ones_like(batch["tokens"])
    batch = program.put_batch(batch, b.batch_sharding)
    with b.plan.rules():
        state, m = step(b.state, batch)
        assert int(m["skipped"]) == 0 and int(state.step) == 1
        # A NaN in one weight makes the loss NaN: the step is skipped, its inputs kept.
        leaves, treedef = jax.tree.flatten(state.params)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
        poisoned = state.replace(params=jax.tree.unflatten(treedef, leaves))
        expect = jax.device_get((poisoned.params, poisoned.opt_state))
        after, m = step(poisoned, batch)
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    assert int(after.step) == 2
    got = jax.device_get((after.params, after.opt_state))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, expect)


def test_unwritable_run_dir_is_one_error_naming_it_before_anything_is_built(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    bad = blocker / "run"
    cfg = config.load(TINY, [*QUIET, f"train.run_dir={bad}", "data.kind=synthetic"])
    with pytest.raises(rundir.RunDirError, match=f"train.run_dir='{bad}' is not writable"):
        train.run(cfg)
    assert blocker.read_text() == "not a directory"


def test_free_space_warning_compares_the_filesystem_with_the_checkpoint_size(tmp_path):
    from etils import epath

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    path = epath.Path(tmp_path)
    assert rundir.free_space_warning(path, 1024, keep=3) is None
    one = rundir.free_space_warning(path, 4 * free, keep=3)
    assert one and str(tmp_path) in one and "less than one checkpoint needs" in one
    # Room for one, not for keep + 1 (orbax removes the oldest only after the new one landed).
    some = rundir.free_space_warning(path, free // 2, keep=3)
    assert some and "less than 4 checkpoints needs" in some and "checkpoint.keep=3" in some
    state = {"w": jnp.zeros((3, 5), jnp.bfloat16), "m": jax.ShapeDtypeStruct((7,), jnp.float32)}
    assert rundir.state_bytes(state) == 3 * 5 * 2 + 7 * 4


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs Linux prlimit")
def test_a_checkpoint_write_that_fails_is_one_line_and_keeps_the_previous_one(tmp_path):
    # A real write failure: once checkpoint 4 is complete, the running trainer's file-size limit
    # drops to 64 KiB (Python ignores SIGXFSZ), so orbax's next write fails with EFBIG.
    cmd = _cli(
        tmp_path,
        "data.kind=synthetic",
        "train.steps=400",
        "train.log_every=1",
        "checkpoint.every=4",
        "train.tensorboard=false",
    )
    with running(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    ) as proc:
        deadline = time.monotonic() + 180
        while not (tmp_path / "checkpoints/4/commit_success.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint 4"
            time.sleep(0.01)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "ERROR:" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"writing checkpoint {tmp_path / 'checkpoints'}/8 failed" in line, line
    assert "File too large" in line, line
    assert f"the previous checkpoint {tmp_path / 'checkpoints' / '4'} is complete and kept" in line
    assert _checkpoints(tmp_path) == [4]
    # With room again, the same command resumes from checkpoint 4.
    again = subprocess.run(
        _cli(tmp_path, "data.kind=synthetic", "train.steps=6", "train.log_every=1"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    compiled = [r["step"] for r in _rows(tmp_path) if r.get("event") == "compiled"]
    assert compiled[-1] == 4 and _checkpoints(tmp_path)[-1] == 6
