"""The training loop: build state (already sharded), resume, step, log, evaluate, checkpoint."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from moetext import checkpoint as checkpoint_lib
from moetext import config as config_lib
from moetext import data as data_lib
from moetext import models, optim
from moetext.checkpoint import Checkpointer, abstract_like
from moetext.config import Config
from moetext.data.batch import unigram_entropy
from moetext.models.flops import flops_per_token
from moetext.sharding import plan as sharding_plan
from moetext.train import metrics as metrics_lib
from moetext.train import nonfinite, preemption, rundir
from moetext.train import peak as peak_lib
from moetext.train.profiler import StepProfiler
from moetext.train.state import TrainState
from moetext.train.step import make_eval_step, make_train_step, make_train_step_parts


@dataclasses.dataclass
class Built:
    """Everything `run` needs, built once from the config."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef[nnx.Module]
    rest: nnx.State[Any, Any]
    state: TrainState
    tx: Any
    lr_schedule: Any
    batch_sharding: NamedSharding
    plan: sharding_plan.Plan
    state_shardings: Any  # TrainState of NamedShardings (out_shardings of every step)


def build(
    cfg: Config,
    devices: list[jax.Device] | None = None,
    *,
    abstract: bool = False,
    plan: sharding_plan.Plan | None = None,
) -> Built:
    """Mesh and rules from cfg.sharding; the train state created already sharded by them.

    abstract=True creates nothing: state and rest are ShapeDtypeStructs carrying their shardings
    (ahead-of-time compilation for devices this process cannot use).
    """
    if plan is None:
        plan = make_plan(cfg, devices)
    family = models.get_family(cfg.model.family)
    # Before anything is traced: one error naming the family if the preset misses an axis.
    plan.check_names(sorted(family.logical_axes), f"model family {family.name!r}")
    tx = optim.build(cfg.optim, cfg.train.steps)
    lr_schedule = optim.schedule(cfg.optim, cfg.train.steps)

    def create() -> tuple[TrainState, nnx.State[Any, Any]]:
        # flax types nnx.split with two filters as a variadic tuple of States.
        _, params, rest = nnx.split(create_model(cfg), nnx.Param, ...)  # type: ignore[misc]
        key = jax.random.key_data(jax.random.key(cfg.train.seed + 1))
        state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), key)
        return state, rest

    graphdef = nnx.split(nnx.eval_shape(lambda: create_model(cfg)), nnx.Param, ...)[0]
    # Shardings come from the params' logical names (checked against the rules here, before
    # anything compiles); the jitted init then creates every shard on its own device.
    abstract_tree = jax.eval_shape(create)
    shardings = (plan.shardings_for(abstract_tree[0]), plan.shardings_for(abstract_tree[1]))
    if abstract:
        state, rest = jax.tree.map(
            # jax.ShapeDtypeStruct.__init__ has no annotations.
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),  # type: ignore[no-untyped-call]
            abstract_tree,
            shardings,
        )
    else:
        state, rest = jax.jit(create, out_shardings=shardings)()
    return Built(
        cfg,
        plan.mesh,
        graphdef,
        rest,
        state,
        tx,
        lr_schedule,
        plan.batch_sharding,
        plan,
        shardings[0],
    )


def make_plan(cfg: Config, devices: list[jax.Device] | None = None) -> sharding_plan.Plan:
    num_devices = len(devices) if devices is not None else jax.device_count()
    config_lib.validate_for_devices(cfg, num_devices)
    return sharding_plan.make_plan(cfg.sharding, devices)


def jit_train_step(b: Built) -> Any:
    """The train step with the plan's shardings pinned on both sides (state donated); with
    train.grad_accum_steps > 1 also the gradient accumulator and the micro-batches. With
    train.separate_update it is two programs (`TwoPrograms`), else one jitted function; both
    are called, lowered and compiled alike."""
    args = (b.graphdef, b.rest, b.tx, b.lr_schedule)
    kwargs = {
        "skip_nonfinite": b.cfg.train.skip_nonfinite_steps > 0,
        "grad_accum_steps": b.cfg.train.grad_accum_steps,
        "param_shardings": b.state_shardings.params,
        "batch_sharding": b.batch_sharding,
    }
    replicated = b.plan.replicated
    if not b.cfg.train.separate_update:
        return jax.jit(
            make_train_step(*args, **kwargs),
            in_shardings=(b.state_shardings, b.batch_sharding),
            out_shardings=(b.state_shardings, replicated),
            donate_argnums=0,
        )
    gradient, update = make_train_step_parts(*args, **kwargs)
    return TwoPrograms(
        # The whole state is an argument (kept though only the params are read) so that the
        # program's memory analysis counts everything resident while it runs.
        jax.jit(
            gradient,
            in_shardings=(b.state_shardings, b.batch_sharding),
            out_shardings=(b.state_shardings.params, replicated),
            keep_unused=True,
        ),
        jax.jit(
            update,
            in_shardings=(b.state_shardings, b.state_shardings.params, replicated),
            out_shardings=(b.state_shardings, replicated),
            donate_argnums=0,
        ),
    )


@dataclasses.dataclass(frozen=True)
class TwoPrograms:
    """The train step as two programs, the gradient then the update (train.separate_update):
    `update(state, *gradient(state, batch))`. The same at every stage: jitted functions, then
    `lower(state, batch)` gives their Lowered, `compile()` their Compiled; each stage is called
    like the one-program step. One program would end the backward's layer scan inside the
    program that consumes its stacked gradient, for which XLA:TPU keeps a second copy of it
    after buffer assignment (docs/performance.md); handed over as an output it does not."""

    gradient: Any
    update: Any

    def __call__(self, state: TrainState, batch: dict[str, jax.Array]) -> Any:
        grads, losses = self.gradient(state, batch)
        return self.update(state, grads, losses)

    def lower(self, state: TrainState, batch: dict[str, jax.Array]) -> TwoPrograms:
        gradient = self.gradient.lower(state, batch)
        grads, losses = gradient.out_info  # the update is lowered for what the gradient returns
        return TwoPrograms(gradient, self.update.lower(state, grads, losses))

    def compile(self, compiler_options: dict[str, str] | None = None) -> TwoPrograms:
        return TwoPrograms(
            self.gradient.compile(compiler_options=compiler_options),
            self.update.compile(compiler_options=compiler_options),
        )


def lower_checked(b: Built, jitted: Any, *args: Any) -> Any:
    """Traces `jitted` under the logical rules, then checks every activation name had a rule."""
    with b.plan.rules(), sharding_plan.record_logical_names() as names:
        lowered = jitted.lower(*args)
    b.plan.check_names(names, "an activation constraint")
    return lowered


def create_model(cfg: Config) -> nnx.Module:
    return models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=cfg.train.seed))


def params_target(cfg: Config, plan: sharding_plan.Plan) -> checkpoint_lib.ParamsTarget:
    """What `checkpoint.load_params` restores onto for a run of cfg on plan."""
    family = models.get_family(cfg.model.family)
    return checkpoint_lib.ParamsTarget.of_model(
        cfg,
        create_model,
        plan.shardings_for,
        stack_layers=family.stack_layers,
        unstack_layers=family.unstack_layers,
    )


def run(cfg: Config) -> dict[str, Any]:
    """Trains to cfg.train.steps, resuming from the newest checkpoint; returns the last metrics."""
    # Unwritable run dir: one line before anything is built or compiled.
    run_dir = rundir.prepare(cfg.train.run_dir)
    plan = make_plan(cfg)
    # Data before the model: a missing dataset or a tokenizer too large for the model fails
    # here, before anything compiles. Each process reads only the rows its devices hold.
    rows = local_rows(plan.batch_sharding, cfg.data.global_batch_size)
    data = data_lib.build(cfg.data, cfg.model.vocab_size, rows)
    if jax.process_index() == 0:
        config_lib.save(cfg, run_dir / "config.yml")
        data_lib.save_tokenizer(data, run_dir)
    b = build(cfg, plan=plan)
    ckpt = Checkpointer(cfg.checkpoint, run_dir) if cfg.checkpoint.enabled else None
    if ckpt and jax.process_index() == 0:
        size = rundir.state_bytes(b.state)
        if warning := rundir.free_space_warning(run_dir, size, cfg.checkpoint.keep):
            print(warning, file=sys.stderr, flush=True)
    state = _maybe_resume(b, ckpt, data)
    if state is b.state and cfg.checkpoint.load_params_from:
        # A new run from another checkpoint's params: free the random ones first (the loaded
        # ones take their place on every device), keep the fresh optimizer state and step 0.
        jax.tree.map(lambda x: x.delete(), state.params)
        src = cfg.checkpoint.load_params_from
        params = checkpoint_lib.load_params(src, cfg, params_target(cfg, b.plan))
        state = dataclasses.replace(state, params=params)
        b.state = state
        if jax.process_index() == 0:
            print(f"params from {src}", file=sys.stderr, flush=True)
    start = int(state.step)

    train_step = jit_train_step(b)
    eval_step = jax.jit(
        make_eval_step(b.graphdef, b.rest, cfg.train.grad_accum_steps, b.batch_sharding),
        in_shardings=(b.state_shardings.params, b.batch_sharding),
    )

    def put(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return put_batch(batch, b.batch_sharding, rows, cfg.data.global_batch_size)

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
    peak = peak_lib.select(cfg.train.peak_tflops)
    cfg_dict = config_lib.to_dict(cfg)  # saved with every checkpoint, checked on resume

    log = metrics_lib.MetricsLog(
        run_dir,
        cfg.train.steps,
        start,
        cfg.train.progress_bar,
        tensorboard=cfg.train.tensorboard,
        moe_pattern=models.get_family(cfg.model.family).moe_layers(cfg.model),
    )
    log.info(peak.describe())
    last: dict[str, Any] = {"step": start}
    eval_set: list[dict[str, jax.Array]] | None = None
    unigram = float("nan")  # of this process's eval rows
    preempt = preemption.Preemption(sync_every=cfg.train.log_every)
    last_ckpt = ckpt.latest_path if ckpt else lambda: None
    guard = nonfinite.NonFiniteGuard(cfg.train.skip_nonfinite_steps, last_ckpt, log)
    profiler = StepProfiler(
        cfg.train.profile_steps, cfg.train.profile_processes, os.fspath(run_dir)
    )
    try:
        batch = put(data.next_batch()) if start < cfg.train.steps else None
        if batch is not None:
            # Compile before the clock starts so step times measure steps, not compilation.
            t0 = time.perf_counter()
            train_step = lower_checked(b, train_step, state, batch).compile()
            compile_s = time.perf_counter() - t0
            log.write({"step": start, "event": "compiled", "compile_s": compile_s, **peak.fields()})
        t_last, steps_since = time.perf_counter(), 0
        for step in range(start, cfg.train.steps):
            if line := profiler.before_step(step + 1, state):
                log.info(line)
            state, m = train_step(state, batch)
            data_state = data.get_state()  # the position after this step's batch
            if step + 1 < cfg.train.steps:
                batch = put(data.next_batch())  # host work overlaps the dispatched step
            steps_since += 1
            log.advance()
            done = step + 1
            guard.record(done, m)
            stop = preempt.should_stop(done)  # every process agrees on the step
            if done % cfg.train.log_every == 0 or done == cfg.train.steps or stop:
                m = jax.device_get(m)  # waits for the step: the interval below is real time
                dt = (time.perf_counter() - t_last) / steps_since
                tps = tokens_per_step / dt
                last = {
                    "step": done,
                    **metrics_lib.to_host(m),
                    "step_time_s": dt,
                    "tokens_per_s": tps,
                    "mfu": metrics_lib.mfu(fpt, tps, peak, jax.device_count()),
                }
                if cfg.train.eval_every and done % cfg.train.eval_every == 0:
                    if eval_set is None:
                        eval_set = [put(e) for e in data.eval_batches()]
                        unigram = unigram_entropy(data.eval_batches())
                    with b.plan.rules():  # eval traces on its first call
                        last.update(_evaluate(eval_step, state.params, eval_set))
                    last["eval_unigram_entropy"] = unigram
                log.write(last)
                guard.check()
                t_last, steps_since = time.perf_counter(), 0
            if ckpt and (done % cfg.checkpoint.every == 0 or done == cfg.train.steps or stop):
                guard.check_before_save(done, state)
                meta = {"step": done, "config": cfg_dict}
                ckpt.save(done, state, meta, data_state, force=stop)
            if stop:
                last["preempted"] = True
                preempt.finish(done, ckpt, log)
                break
    finally:
        if line := profiler.stop(state):
            log.info(line)
        preempt.close()
        log.close()
        data.close()
        if ckpt:
            ckpt.close()
    return last


def _maybe_resume(b: Built, ckpt: Checkpointer | None, data: data_lib.TrainData) -> TrainState:
    """The newest usable checkpoint's state (data position restored), else the fresh state."""
    if ckpt is None or not b.cfg.checkpoint.resume:
        return b.state
    directory, changes = ckpt.directory, {}

    def check_meta(step: int, meta: dict[str, Any]) -> None:  # before any array is read
        where = f"checkpoint {directory}/{step}"
        changes[step] = checkpoint_lib.check_config(meta.get("config"), b.cfg, where)

    found = ckpt.restore_latest(abstract_like(b.state), check_meta)
    if found is None:
        return b.state
    step, restored, _, data_states = found
    state: TrainState = restored
    if changes[step] and jax.process_index() == 0:
        print(f"resume: checkpoint {directory}/{step}: {'; '.join(changes[step])}", file=sys.stderr)
    data.restore(data_states)
    return state


def local_rows(sharding: NamedSharding, global_rows: int) -> list[int]:
    """The global batch rows this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map((global_rows, 1))
    return sorted(
        {r for idx in index_map.values() if idx for r in range(*idx[0].indices(global_rows))}
    )


def put_batch(
    batch: dict[str, np.ndarray],
    sharding: NamedSharding,
    rows: Sequence[int] | None = None,
    global_rows: int | None = None,
) -> dict[str, jax.Array]:
    """Batch rows as global sharded arrays: each device gets its rows.

    `batch` holds the global batch, or with `rows` only those global rows (this process's,
    see local_rows) out of `global_rows`.
    """
    n = len(next(iter(batch.values())))
    rows, global_rows = (range(n), n) if rows is None else (rows, global_rows or n)
    where = {r: i for i, r in enumerate(rows)}

    def put(v: np.ndarray) -> jax.Array:
        def shard(idx: tuple[slice, ...] | None) -> np.ndarray:
            assert idx is not None  # a batch is never a scalar
            picked = [where[r] for r in range(*idx[0].indices(global_rows))]
            return v[picked][(slice(None), *idx[1:])]

        return jax.make_array_from_callback((global_rows, *v.shape[1:]), sharding, shard)

    return {k: put(v) for k, v in batch.items()}


def _evaluate(
    eval_step: Callable[..., dict[str, jax.Array]],
    params: Any,
    eval_set: list[dict[str, jax.Array]],
) -> dict[str, float]:
    """Mean eval_loss over the fixed batches; perplexity from the token-weighted CE."""
    out = [jax.device_get(eval_step(params, batch)) for batch in eval_set]
    nll = sum(float(o["eval_nll_sum"]) for o in out)
    tokens = max(sum(float(o["eval_tokens"]) for o in out), 1.0)
    return {
        "eval_loss": sum(float(o["eval_loss"]) for o in out) / len(out),
        "eval_ce_loss": nll / tokens,
        "eval_perplexity": float(np.exp(nll / tokens)),
    }
