"""The training loop: build state (already sharded), resume, step, log, evaluate, checkpoint.

`run` reads top to bottom; what it calls each lives in its own module: the compiled programs
(moetext.program), where the run starts (resume.py), evaluation (evaluate.py), step time and
MFU (throughput.py), the metric sinks (metrics.py), the non-finite policy (nonfinite.py),
preemption (preemption.py), the profiler window (profiler.py) and the routing trace
(routing_trace.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from moetext import compilation_cache, models
from moetext import config as config_lib
from moetext import data as data_lib
from moetext.checkpoint import Checkpointer
from moetext.config import Config
from moetext.program import (
    Built,
    TrainState,
    build,
    jit_train_step,
    local_rows,
    lower_checked,
    make_plan,
    put_batch,
)
from moetext.train import metrics as metrics_lib
from moetext.train import nonfinite, preemption, resume, rundir
from moetext.train.batch_hash import global_batch_hash
from moetext.train.evaluate import Evaluator
from moetext.train.profiler import StepProfiler
from moetext.train.routing_trace import RoutingTrace
from moetext.train.throughput import Throughput

Batch = dict[str, jax.Array]


def run(cfg: Config) -> dict[str, Any]:
    """Trains to cfg.train.steps, resuming from the newest checkpoint; returns the last metrics."""
    models.check_names(cfg.model, cfg.moe)  # an unknown family or router: before data and model
    plan = make_plan(cfg)
    # Data before the run dir and the model: a missing dataset or tokenizer, or a tokenizer
    # too large for the model, fails here, before anything is written or compiled (a failed
    # start leaves no run dir behind). Each process reads only the rows its devices hold.
    rows = local_rows(plan.batch_sharding, cfg.data.global_batch_size)
    data = data_lib.build(cfg.data, cfg.model.vocab_size, rows)
    try:  # unwritable: one line before anything is built or compiled
        run_dir = rundir.prepare(cfg.train.run_dir)
    except BaseException:
        data.close()
        raise
    if jax.process_index() == 0:
        config_lib.save(cfg, run_dir / "config.yml")
        data_lib.save_tokenizer(data, run_dir)
    b = build(cfg, plan=plan)
    ckpt = resume.checkpointer(cfg, run_dir, b.state)
    state = resume.initial_state(b, ckpt, data)
    start = int(state.step)

    def put(batch: dict[str, np.ndarray]) -> Batch:
        return put_batch(batch, b.batch_sharding, rows, cfg.data.global_batch_size)

    def hash_batch(batch: dict[str, np.ndarray]) -> str:
        return global_batch_hash(batch, rows, cfg.data.global_batch_size)

    speed = Throughput(cfg)
    moe_pattern = models.get_family(cfg.model.family).moe_layers(cfg.model)
    log = metrics_lib.MetricsLog(
        run_dir,
        cfg.train.steps,
        start,
        cfg.train.progress_bar,
        tensorboard=cfg.train.tensorboard,
        moe_pattern=moe_pattern,
    )
    log.info(speed.peak.describe())
    if cfg.moe.routing_override != "none":  # a benchmark's numbers hold for forced routing only
        log.info(
            f"moe.routing_override={cfg.moe.routing_override}: the router's choice is replaced "
            f"(balanced or random experts, weights 1/K); step times measure that routing"
        )
    last_ckpt = ckpt.latest_path if ckpt else lambda: None
    parts = _Parts(
        b,
        data,
        put,
        ckpt,
        log,
        speed,
        Evaluator(b, data, put),
        preemption.Preemption(sync_every=cfg.train.log_every),
        nonfinite.NonFiniteGuard(cfg.train.skip_nonfinite_steps, last_ckpt, log),
        StepProfiler(cfg.train.profile_steps, cfg.train.profile_processes, os.fspath(run_dir)),
        RoutingTrace(b, run_dir, moe_pattern),
        config_lib.to_dict(cfg),  # saved with every checkpoint, checked on resume
        state,
        hash_batch if cfg.train.log_batch_hash else None,
    )
    try:
        return _train(parts, start)
    finally:
        parts.close()


@dataclasses.dataclass
class _Parts:
    """What one run's step loop calls, built by `run`; `state` is the latest train state."""

    b: Built
    data: data_lib.TrainData
    put: Callable[[dict[str, np.ndarray]], Batch]
    ckpt: Checkpointer | None
    log: metrics_lib.MetricsLog
    speed: Throughput
    evaluator: Evaluator
    preempt: preemption.Preemption
    guard: nonfinite.NonFiniteGuard
    profiler: StepProfiler
    trace: RoutingTrace
    cfg_dict: dict[str, Any]
    state: TrainState
    hash_batch: Callable[[dict[str, np.ndarray]], str] | None  # train.log_batch_hash

    def next_batch(self) -> tuple[Batch, str | None]:
        """The next global batch on the devices, and its hash when train.log_batch_hash."""
        host = self.data.next_batch()
        return self.put(host), None if self.hash_batch is None else self.hash_batch(host)

    def close(self) -> None:
        if line := self.profiler.stop(self.state):
            self.log.info(line)
        self.preempt.close()
        self.log.close()
        self.data.close()
        if self.ckpt:
            self.ckpt.close()


def _train(p: _Parts, start: int) -> dict[str, Any]:
    """Steps from `start` to train.steps (or a preemption); the last logged metrics."""
    cfg, steps = p.b.cfg, p.b.cfg.train.steps
    train_step = jit_train_step(p.b)
    last: dict[str, Any] = {"step": start}
    batch, batch_hash = p.next_batch() if start < steps else (None, None)
    if batch is not None:
        # Compile before the clock starts so step times measure steps, not compilation.
        t0, hits0 = time.perf_counter(), compilation_cache.hits()
        train_step = lower_checked(p.b, train_step, p.state, batch).compile()
        compile_s = time.perf_counter() - t0
        row = {"step": start, "event": "compiled", "compile_s": compile_s}
        if hits0 is not None:  # the persistent cache is on: programs it served, not compiled
            row["compile_cache_hits"] = (compilation_cache.hits() or 0) - hits0
        p.log.write({**row, **p.speed.peak.fields()})
        p.trace.compile(p.state, batch, start + 1, steps)
    p.speed.restart()
    for step in range(start, steps):
        if line := p.profiler.before_step(step + 1, p.state):
            p.log.info(line)
        # The routing trace reads the state the step starts from (dispatched first: the step
        # donates it).
        ids = p.trace.run(p.state, batch) if batch and p.trace.due(step + 1) else None
        p.state, m = train_step(p.state, batch)
        if ids is not None:
            p.trace.write(step + 1, ids)
        data_state = p.data.get_state()  # the position after this step's batch
        step_hash = batch_hash
        if step + 1 < steps:
            batch, batch_hash = p.next_batch()  # host work overlaps the dispatched step
        p.speed.step()
        p.log.advance()
        done = step + 1
        p.guard.record(done, m)
        stop = p.preempt.should_stop(done)  # every process agrees on the step
        if done % cfg.train.log_every == 0 or done == steps or stop:
            last = _log(p, done, m, step_hash)
        elif step_hash is not None:  # every step's batch, logged or not
            p.log.write({"step": done, "batch_hash": step_hash})
        if p.ckpt and (done % cfg.checkpoint.every == 0 or done == steps or stop):
            # After the step's row, so a kill during the save loses no row; the save's time is
            # a row of its own, left out of the next interval's step time (the wait for the
            # step itself stays in the steps' time; jax: unannotated).
            jax.block_until_ready(p.state)  # type: ignore[no-untyped-call]
            with p.speed.apart("checkpoint"):
                p.guard.check_before_save(done, p.state)
                meta = {"step": done, "config": p.cfg_dict}
                p.ckpt.save(done, p.state, meta, data_state, force=stop)
            p.log.write({"step": done, "checkpoint_time_s": p.speed.take("checkpoint")})
        if stop:
            last["preempted"] = True
            p.preempt.finish(done, p.ckpt, p.log)
            break
    return last


def _log(p: _Parts, done: int, m: dict[str, jax.Array], batch_hash: str | None) -> dict[str, Any]:
    """Writes step `done`'s metrics row (with evaluation when it is due); returns it."""
    m = jax.device_get(m)  # waits for the step: the interval below is real time
    evaluation = {}
    if p.evaluator.due(done):
        with p.speed.apart("eval"):
            evaluation = p.evaluator(p.state)
    last = {"step": done, **metrics_lib.to_host(m), **p.speed.fields(), **evaluation}
    if batch_hash is not None:
        last["batch_hash"] = batch_hash
    p.log.write(last)
    p.guard.check()
    p.speed.restart()
    return last
