"""Where a traced CPU step's time goes: the XLA:CPU operations of a `jax.profiler` trace, per step.

    .venv/bin/python -m train configs/models/bench-tiny-moe.yml train.steps=30 \\
        train.profile_steps=[20,23] train.run_dir=runs/prof
    .venv/bin/python scripts/profile_summary.py runs/prof [--program train_step] [--top 20]

Reads the newest Perfetto trace (`perfetto_trace.json.gz`) under the directory (a run dir, its
tensorboard/ or one profile folder). Steps are the dispatches of the jitted functions whose
name starts with --program (the trainer's `train_step_gradient` and `train_step_update`, or
`train_step` as one program): the most often dispatched of them counts the steps. Operations
are the events on XLA:CPU's threads (the executor's and its pool's) except the executor's own
frames and loop or branch containers; an Eigen dot (`dot...`), which runs on the thread pool
after its event returns, is timed from its start to its "end:" event. Per step it prints the
operations' count and time by kind (the name without its numeric suffix: `ynn_fusion` a
YNNPACK dot or reduction, `dot_general` an Eigen dot, `*_fusion` elementwise loops, ...) and
the longest operations by name. Names are the compiled HLO's: `XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text` writes the modules that say what each one computes (each program
numbers its own, so a name can recur across them).

Op time sums over the worker threads (two operations can run at once) and leaves out the work
a YNNPACK or Eigen dot hands to the other thread, so it is neither the wall time nor the CPU
time; it says which operations the step waits on. TPU and GPU traces hold device timelines
instead: read those in TensorBoard or Perfetto (docs/performance.md, "Profiling").
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

# XLA:CPU's threads: the executor's ("tf_XLAExecute/<id>"; a small program runs there) and the
# intra-op pool's ("tf_XLAEigen/<id>")
WORKER = re.compile(r"XLAEigen|XLAExecute")
CONTAINERS = re.compile(r"^(ThunkExecutor|ThreadpoolListener|SlinkyThreadPool|while|cond)\b")
ASYNC = re.compile(r"^(dot|dot_general|convolution)(\.\d+)*$")  # XLA:CPU's Eigen contractions
SUFFIX = re.compile(r"(\.\d+)+(\.clone(\.\d+)?)?$")


def newest_trace(root: Path) -> Path:
    found = sorted(root.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"profile_summary: no perfetto_trace.json.gz under {root}")
    return found[-1]


def _outermost(calls: list[dict[str, Any]]) -> int:
    """How many of these spans lie inside no other (the profiler records a dispatch twice, one
    span inside the other)."""
    count, end = 0, float("-inf")
    for e in sorted(calls, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        if e["ts"] >= end:
            count, end = count + 1, e["ts"] + e.get("dur", 0.0)
    return count


def summarize(events: list[dict[str, Any]], program: str) -> dict[str, Any]:
    """Steps, per-step op time by kind and by name, from a Perfetto trace's events."""
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [e for e in events if e.get("ph") == "X"]
    # "PjitFunction(train_step)", or "PjitFunction(jit(train_step_gradient))" for the trainer's
    dispatch = re.compile(rf"PjitFunction\((jit\()?{re.escape(program)}")
    dispatches: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in spans:
        if dispatch.match(e["name"]):
            dispatches[e["name"]].append(e)
    if not dispatches:
        raise SystemExit(
            f"profile_summary: no dispatch of a jitted function named {program}* in the trace"
        )
    steps = max(_outermost(calls) for calls in dispatches.values())
    worker = [e for e in spans if WORKER.search(threads.get((e["pid"], e["tid"]), ""))]
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for e in worker:
        if e["name"].startswith("end: "):
            ends[e["name"][5:]].append(e["ts"])
    for ts in ends.values():
        ts.sort()
    by_name: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for e in worker:
        name = e["name"]
        if name.startswith("end: ") or CONTAINERS.match(name):
            continue
        dur = e.get("dur", 0.0)
        done = ends.get(name, []) if ASYNC.match(name) else []
        i = bisect.bisect_left(done, e["ts"])  # its end event: the first at or after its start
        if i < len(done):  # an Eigen dot runs on the pool after its event returns, until then
            dur = max(dur, done[i] - e["ts"])
        by_name[name] += dur
        calls[name] += 1
    by_kind: collections.Counter[str] = collections.Counter()
    kind_calls: collections.Counter[str] = collections.Counter()
    for name, us in by_name.items():
        kind = SUFFIX.sub("", name)
        by_kind[kind] += us
        kind_calls[kind] += calls[name]
    return {
        "steps": steps,
        "programs": sorted(dispatches),
        "by_kind": by_kind,
        "kind_calls": kind_calls,
        "by_name": by_name,
        "calls": calls,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", help="a run dir (or any directory above a perfetto_trace.json.gz)")
    p.add_argument("--program", default="train_step", help="jitted function name prefix")
    p.add_argument("--top", type=int, default=20, help="kinds and operations listed")
    args = p.parse_args()
    root = Path(args.dir)
    if not root.is_dir():
        raise SystemExit(f"profile_summary: {args.dir} is not a directory")
    path = newest_trace(root)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    s = summarize(events, args.program)
    n = s["steps"]
    total = sum(s["by_kind"].values())
    print(f"trace: {path}")
    print(f"steps: {n} (dispatches of {', '.join(s['programs'])})")
    print(
        f"XLA:CPU operations per step: {sum(s['calls'].values()) / n:.0f}, "
        f"{total / n / 1e3:.1f} ms of operation time"
    )
    print(f"\n{'kind':<40}{'ops/step':>10}{'ms/step':>10}{'share':>8}")
    for kind, us in s["by_kind"].most_common(args.top):
        print(
            f"{kind:<40}{s['kind_calls'][kind] / n:>10.0f}{us / n / 1e3:>10.2f}{us / total:>8.1%}"
        )
    print(f"\n{'operation':<40}{'calls/step':>10}{'ms/step':>10}")
    for name, us in s["by_name"].most_common(args.top):
        print(f"{name:<40}{s['calls'][name] / n:>10.1f}{us / n / 1e3:>10.2f}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # the reader (| head) stopped early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
