"""train.routing_trace: the window's steps, and nothing else, write each MoE layer's chosen
experts ([B, S, K] int32 global ids) of the routing that step used."""

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fake_devices import run_worker
from moetext import config, train
from moetext.train.metrics import max_violation

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
B, S, E, K = 8, 16, 8, 2  # tiny config: 8 experts, top-2; short rows keep it fast
COMMON = [
    "train.progress_bar=false",
    "train.peak_tflops=1.0",
    "train.tensorboard=false",
    "checkpoint.enabled=false",
    "train.log_every=1",
    "data.kind=synthetic",
    f"data.seq_len={S}",
    f"data.global_batch_size={B}",
]


def _trace(run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    out = {}
    for f in (run_dir / "routing_trace").iterdir():
        assert f.name.startswith("step_") and f.suffix == ".npz", f.name
        with np.load(f) as z:
            out[int(f.stem.removeprefix("step_"))] = {k: z[k] for k in z.files}
    return out


def _balanced_ids(b: int) -> np.ndarray:
    """routing_override=balanced sends token t of what one MoE block sees to (t K + j) mod E.
    With grad_accum_steps=2 a block sees micro-batch i = rows i, 2 + i, ... flattened
    row-major, so the batch's row r = 2 m + i holds micro-batch tokens t = m S + s."""
    r_B, s_S, j_K = np.meshgrid(np.arange(b), np.arange(S), np.arange(K), indexing="ij")
    t = (r_B // 2) * S + s_S
    return (t * K + j_K) % E


def test_balanced_override_with_micro_batches_gives_the_known_ids(tmp_path):
    # The trace runs micro-batch by micro-batch and puts the rows back in batch order.
    cfg = config.load(
        TINY,
        [
            *COMMON,
            f"train.run_dir={tmp_path}",
            "train.steps=3",
            "train.routing_trace=[2,3]",
            "moe.routing_override=balanced",
            "train.grad_accum_steps=2",
        ],
    )
    train.run(cfg)
    trace = _trace(tmp_path)
    assert sorted(trace) == [2, 3]
    assert not list((tmp_path / "routing_trace").glob("*.tmp"))
    want = _balanced_ids(B)
    for step in (2, 3):
        assert sorted(trace[step]) == ["layer_0", "layer_1"]
        for ids in trace[step].values():
            assert ids.dtype == np.int32 and ids.shape == (B, S, K)
            np.testing.assert_array_equal(ids, want)


def test_trace_is_the_routing_each_step_used(tmp_path):
    # sigmoid_topk with the bias moving (rate 0.05 against sigmoid scores near 0.5 at init, so
    # every update moves many tokens): each traced step's ids must count to exactly the loads
    # the train step itself logged for that step (max_vio: max/mean - 1 of integer counts, so
    # equal counts give equal floats), and for the last step to its per-expert counts. Ids
    # from the params and bias after the update would route differently.
    cfg = config.load(
        TINY,
        [
            *COMMON,
            f"train.run_dir={tmp_path}",
            "train.steps=3",
            "train.routing_trace=[1,3]",
            "moe.router=sigmoid_topk",
            "moe.bias_update_rate=0.05",
        ],
    )
    last = train.run(cfg)
    trace = _trace(tmp_path)
    assert sorted(trace) == [1, 2, 3]
    rows = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r}
    for step, layers in trace.items():
        for name, ids in layers.items():
            assert ids.shape == (B, S, K) and ids.dtype == np.int32
            assert ids.min() >= 0 and ids.max() < E
            # top-k picks K distinct experts per token
            assert (np.sort(ids, axis=-1)[..., 1:] != np.sort(ids, axis=-1)[..., :-1]).all()
            counts = np.bincount(ids.reshape(-1), minlength=E)
            logged = rows[step][f"max_vio/{name}"]
            assert max_violation(counts[None])[0] == logged, (step, name, counts, logged)
    # The last step's exact per-expert counts ([num_moe_layers, E], layers 0 and 1 in order).
    counts_LE = np.stack(
        [np.bincount(trace[3][f"layer_{i}"].reshape(-1), minlength=E) for i in (0, 1)]
    )
    np.testing.assert_array_equal(counts_LE, last["expert_counts"])
    # Routing moves from step to step.
    assert (trace[2]["layer_0"] != trace[3]["layer_0"]).any()


def test_two_processes_gather_the_global_batch_to_process_0(tmp_path):
    # Two processes of 2 fake devices each, experts and tokens sharded (fsdp_ep): every process
    # holds half the rows, process 0 writes the whole batch's ids in row order.
    port = _free_port()
    args = [
        str(TINY),
        *COMMON,
        f"train.run_dir={tmp_path}",
        "train.steps=2",
        "train.routing_trace=[2,2]",
        "moe.routing_override=balanced",
        "train.grad_accum_steps=2",
        "sharding.preset=fsdp_ep",
    ]

    def process(i: int) -> dict:
        addr = f"127.0.0.1:{port}"
        return run_worker(
            "tests.train.routing_trace_worker", addr, "2", str(i), *args, timeout_s=600, devices=2
        )

    # Both at once: each blocks in jax.distributed.initialize until the other joins.
    with ThreadPoolExecutor(2) as pool:
        assert [r["process"] for r in pool.map(process, range(2))] == [0, 1]
    trace = _trace(tmp_path)
    assert sorted(trace) == [2]
    for ids in trace[2].values():
        np.testing.assert_array_equal(ids, _balanced_ids(B))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
