"""Metric sinks: metrics.jsonl after a resume, TensorBoard events read back, the MFU peak."""

import glob
import gzip
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from moetext.train import metrics as metrics_lib
from moetext.train import peak as peak_lib
from moetext.train import throughput
from moetext.train.profiler import StepProfiler


def _rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _events(run_dir):
    """Every Event of run_dir/tensorboard/, read straight from the TFRecord framing."""
    out = []
    for path in sorted(glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            pos += 12  # length + its CRC
            out.append(event_pb2.Event.FromString(data[pos : pos + n]))
            pos += n + 4  # payload + its CRC
    return out


def _values(events, field):
    """{(tag, step): value.<field>} of the summary values that set `field`."""
    return {
        (v.tag, e.step): getattr(v, field)
        for e in events
        for v in e.summary.value
        if v.HasField(field)
    }


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "event": "compiled", "compile_s": 1.0}) + "\n")
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "loss": 10.0 - step / 10}) + "\n")
        f.write('{"step": 21, "lo')  # torn by the kill
    log = metrics_lib.MetricsLog(str(tmp_path), 30, start_step=10, progress_bar=False)
    log.write({"step": 11, "loss": 1.0})
    log.close()
    steps = [r["step"] for r in _rows(tmp_path) if "loss" in r]
    assert steps == list(range(1, 12))
    assert _rows(tmp_path)[0]["event"] == "compiled"
    assert not list(tmp_path.glob("*.tmp"))


def test_tensorboard_gets_every_scalar_and_the_expert_load(tmp_path):
    log = metrics_lib.MetricsLog(
        str(tmp_path), 20, 0, False, tensorboard=True, moe_pattern=(False, True, True)
    )
    load = np.array([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]], np.float32)
    log.write({"step": 0, "event": "compiled", "compile_s": 2.5, "mfu_peak_source": "given"})
    for step in (10, 20):
        log.write({"step": step, "loss": 5.0 / step, "lr": 1e-3, "expert_load": load})
    log.close()

    rows = _rows(tmp_path)
    # JSONL: the per-layer max/mean imbalance (named by decoder layer), not the histogram.
    assert "expert_load" not in rows[-1]
    assert rows[-1]["expert_imbalance/layer_1"] == pytest.approx(1.0)
    assert rows[-1]["expert_imbalance/layer_2"] == pytest.approx(2.8)

    events = _events(tmp_path)
    scalars = _values(events, "simple_value")
    for row in rows:
        for key, value in row.items():
            if key != "step" and not isinstance(value, str):
                assert scalars[(key, row["step"])] == pytest.approx(value), key
    hist = {
        (v.tag, e.step): v.histo for e in events for v in e.summary.value if v.HasField("histo")
    }
    assert set(hist) == {(f"expert_load/layer_{i}", s) for i in (1, 2) for s in (10, 20)}
    h = hist[("expert_load/layer_2", 20)]
    np.testing.assert_allclose(h.bucket, load[1], rtol=1e-6)  # bucket e = expert e
    np.testing.assert_allclose(h.bucket_limit, [0.5, 1.5, 2.5, 3.5])


def test_rows_past_the_moe_layers_are_the_layers_after_the_stack(tmp_path):
    """A DeepSeek-V3 step with multi-token prediction: its MTP layer's row follows the stack's
    MoE layers (HF numbers it model.layers.{num_layers}); mtp_loss is a scalar like any other,
    in metrics.jsonl and TensorBoard."""
    log = metrics_lib.MetricsLog(
        str(tmp_path), 10, 0, False, tensorboard=True, moe_pattern=(False, True, True)
    )
    load = np.array([[0.25] * 4, [0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]], np.float32)
    log.write({"step": 10, "loss": 2.0, "mtp_loss": 2.5, "extra_loss": 0.75, "expert_load": load})
    log.close()
    row = _rows(tmp_path)[-1]
    assert {k for k in row if k.startswith("expert_imbalance/")} == {
        f"expert_imbalance/layer_{i}" for i in (1, 2, 3)
    }
    assert row["expert_imbalance/layer_3"] == pytest.approx(1.6)
    scalars = _values(_events(tmp_path), "simple_value")
    assert scalars[("mtp_loss", 10)] == pytest.approx(2.5)
    assert scalars[("extra_loss", 10)] == pytest.approx(0.75)


def test_resumed_tensorboard_purges_replayed_steps(tmp_path):
    log = metrics_lib.MetricsLog(str(tmp_path), 20, 0, False, tensorboard=True)
    log.write({"step": 10, "loss": 2.0})
    log.close()
    log = metrics_lib.MetricsLog(str(tmp_path), 20, 5, False, tensorboard=True)
    log.close()
    # TensorBoard hides events at or after a SessionLog START's step (purge_step = k + 1).
    starts = [e.step for e in _events(tmp_path) if e.HasField("session_log")]
    assert 6 in starts


def test_to_host_keeps_arrays_and_floats_scalars():
    out = metrics_lib.to_host({"loss": np.float32(2.0), "expert_load": np.ones((2, 4))})
    assert out["loss"] == 2.0 and isinstance(out["loss"], float)
    assert out["expert_load"].shape == (2, 4)


def _never_measure():
    raise AssertionError("measured although a peak was known")


def test_peak_given_beats_table_beats_measurement():
    given = peak_lib.select(2.0, "TPU v5 lite", measure=_never_measure)
    assert given.flops == 2.0e12 and given.source == "train.peak_tflops"
    for kind, tflops in [
        ("TPU v4", 275),
        ("TPU v5 lite", 197),
        ("TPU v5", 459),
        ("TPU v6 lite", 918),
        ("TPU7x", 1153.5),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
    ]:
        p = peak_lib.select(None, kind, measure=_never_measure)
        assert p.flops == pytest.approx(tflops * 1e12), kind
        assert kind in p.source
    measured = peak_lib.select(
        None, "cpu", measure=lambda: (8e11, "fake 4096^3"), devices_sharing_host=4
    )
    assert measured.flops == 2e11  # the host's cores are shared by its 4 devices
    assert measured.source.startswith("measured: fake 4096^3")
    assert "0.2 TFLOP/s per device" in measured.describe()


def test_mfu_never_exceeds_one_the_peak_rises_instead():
    p = peak_lib.Peak(1e12, "measured: fake")
    assert throughput.mfu(1e6, 5e5, p, 1) == pytest.approx(0.5)
    assert throughput.mfu(1e6, 4e6, p, 2) == 1.0  # 2e12 per device > the 1e12 peak
    assert p.flops == 2e12 and p.raised and "train step" in p.source
    assert throughput.mfu(1e6, 2e6, p, 2) == pytest.approx(0.5)  # the raised peak stays


def test_checkpoint_and_eval_time_are_taken_out_of_the_step_time(monkeypatch):
    # A scripted clock (no wall time): 4 steps over 10 s, 3 s of it a save and 1 s an eval.
    from moetext import config

    clock = iter([0.0, 4.0, 7.0, 8.0, 9.0, 10.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    cfg = config.load("configs/models/tiny-qwen3-moe.yml", ["train.peak_tflops=1"])
    speed = throughput.Throughput(cfg)  # interval starts at 0
    for _ in range(4):
        speed.step()
    with speed.apart("checkpoint"):  # 4 -> 7
        pass
    with speed.apart("eval"):  # 8 -> 9
        pass
    f = speed.fields()  # at 10: 10 - 3 - 1 = 6 s of steps
    assert f["step_time_s"] == 1.5 and f["checkpoint_time_s"] == 3.0 and f["eval_time_s"] == 1.0
    assert f["tokens_per_s"] == cfg.data.global_batch_size * cfg.data.seq_len / 1.5


def test_measure_matmul_flops_runs():
    flops, how = peak_lib.measure_matmul_flops(n=256, reps=3)
    assert flops > 0 and how == "bf16 256^3 matmul, best of 3"


def _traced_functions(trace_dir) -> set[str]:
    """Names of the jitted functions whose calls a Perfetto trace recorded."""
    (path,) = glob.glob(str(trace_dir / "plugins/profile/*/perfetto_trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    names = {e.get("name", "") for e in events}
    return {n[len("PjitFunction(") : -1] for n in names if n.startswith("PjitFunction(")}


def test_profiler_traces_exactly_the_window_of_steps(tmp_path):
    prof = StepProfiler((2, 4), (0,), str(tmp_path))
    x = jnp.ones((32, 32))
    lines = []
    for step in range(1, 6):  # each "step" is a differently named jitted function
        if line := prof.before_step(step, x):
            lines.append(line)
        fn = lambda a: a @ a
        fn.__name__ = f"marker_step_{step}"
        x = jax.jit(fn)(x)
    assert prof.stop(x) is None  # already stopped before step 4
    assert lines[0] == f"profiler: tracing steps 2..3 into {tmp_path / 'tensorboard'}"
    traced = {n for n in _traced_functions(tmp_path / "tensorboard") if n.startswith("marker")}
    assert traced == {"marker_step_2", "marker_step_3"}
    assert glob.glob(str(tmp_path / "tensorboard/plugins/profile/*/*.xplane.pb"))


def test_profiler_off_this_process_or_without_a_window_writes_nothing(tmp_path):
    for prof in (
        StepProfiler(None, (0,), str(tmp_path)),
        StepProfiler((1, 3), (1,), str(tmp_path)),
    ):
        assert prof.before_step(1, None) is None and prof.stop(None) is None
    assert not (tmp_path / "tensorboard").exists()
