"""The training loop: build state (already sharded), resume, step, log, evaluate, checkpoint.

`run` reads top to bottom; what it calls each lives in its own module: the compiled programs
(moetext.program), where the run starts (resume.py), evaluation (evaluate.py), step time and
MFU (throughput.py), the metric sinks (metrics.py), the non-finite policy (nonfinite.py),
preemption (preemption.py) and the profiler window (profiler.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from moetext import config as config_lib
from moetext import data as data_lib
from moetext import models
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
from moetext.train.evaluate import Evaluator
from moetext.train.profiler import StepProfiler
from moetext.train.throughput import Throughput

Batch = dict[str, jax.Array]


def run(cfg: Config) -> dict[str, Any]:
    """Trains to cfg.train.steps, resuming from the newest checkpoint; returns the last metrics."""
    # Unwritable run dir: one line before anything is built or compiled.
    run_dir = rundir.prepare(cfg.train.run_dir)
    models.check_names(cfg.model, cfg.moe)  # an unknown family or router: before data and model
    plan = make_plan(cfg)
    # Data before the model: a missing dataset or a tokenizer too large for the model fails
    # here, before anything compiles. Each process reads only the rows its devices hold.
    rows = local_rows(plan.batch_sharding, cfg.data.global_batch_size)
    data = data_lib.build(cfg.data, cfg.model.vocab_size, rows)
    if jax.process_index() == 0:
        config_lib.save(cfg, run_dir / "config.yml")
        data_lib.save_tokenizer(data, run_dir)
    b = build(cfg, plan=plan)
    ckpt = resume.checkpointer(cfg, run_dir, b.state)
    state = resume.initial_state(b, ckpt, data)
    start = int(state.step)

    def put(batch: dict[str, np.ndarray]) -> Batch:
        return put_batch(batch, b.batch_sharding, rows, cfg.data.global_batch_size)

    speed = Throughput(cfg)
    log = metrics_lib.MetricsLog(
        run_dir,
        cfg.train.steps,
        start,
        cfg.train.progress_bar,
        tensorboard=cfg.train.tensorboard,
        moe_pattern=models.get_family(cfg.model.family).moe_layers(cfg.model),
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
        config_lib.to_dict(cfg),  # saved with every checkpoint, checked on resume
        state,
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
    cfg_dict: dict[str, Any]
    state: TrainState

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
    batch = p.put(p.data.next_batch()) if start < steps else None
    if batch is not None:
        # Compile before the clock starts so step times measure steps, not compilation.
        t0 = time.perf_counter()
        train_step = lower_checked(p.b, train_step, p.state, batch).compile()
        compile_s = time.perf_counter() - t0
        p.log.write(
            {"step": start, "event": "compiled", "compile_s": compile_s, **p.speed.peak.fields()}
        )
    p.speed.restart()
    for step in range(start, steps):
        if line := p.profiler.before_step(step + 1, p.state):
            p.log.info(line)
        p.state, m = train_step(p.state, batch)
        data_state = p.data.get_state()  # the position after this step's batch
        if step + 1 < steps:
            batch = p.put(p.data.next_batch())  # host work overlaps the dispatched step
        p.speed.step()
        p.log.advance()
        done = step + 1
        p.guard.record(done, m)
        stop = p.preempt.should_stop(done)  # every process agrees on the step
        if done % cfg.train.log_every == 0 or done == steps or stop:
            last = _log(p, done, m)
        if p.ckpt and (done % cfg.checkpoint.every == 0 or done == steps or stop):
            p.guard.check_before_save(done, p.state)
            meta = {"step": done, "config": p.cfg_dict}
            p.ckpt.save(done, p.state, meta, data_state, force=stop)
        if stop:
            last["preempted"] = True
            p.preempt.finish(done, p.ckpt, p.log)
            break
    return last


def _log(p: _Parts, done: int, m: dict[str, jax.Array]) -> dict[str, Any]:
    """Writes step `done`'s metrics row (with evaluation when it is due); returns it."""
    m = jax.device_get(m)  # waits for the step: the interval below is real time
    last = {"step": done, **metrics_lib.to_host(m), **p.speed.fields()}
    if p.evaluator.due(done):
        last.update(p.evaluator(p.state))
    p.log.write(last)
    p.guard.check()
    p.speed.restart()
    return last
