"""What is compiled, built once from the config: the model split into its train state, the
sharding plan, the jitted train and eval steps, and their lowering under the logical rules.

Training (moetext.train), ahead-of-time compilation (moetext.aot), decoding (moetext.generate)
and the benchmarks build the same programs from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from moetext import checkpoint, models, optim
from moetext import config as config_lib
from moetext.config import Config
from moetext.models import ModelState
from moetext.program.state import TrainState
from moetext.program.step import (
    Batch,
    Metrics,
    make_eval_step,
    make_train_step,
    make_train_step_parts,
)
from moetext.sharding import plan as sharding_plan


@dataclasses.dataclass
class Built:
    """Everything a run needs, built once from the config."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef[nnx.Module]
    rest: nnx.State[Any, Any]  # the model's variables that are neither Param nor ModelState
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

    The model splits three ways: its nnx.Param variables (TrainState.params, what the
    optimizer updates), its models.ModelState variables (TrainState.model_state, possibly
    empty) and the rest (Built.rest, constant). abstract=True creates nothing: state and rest
    are ShapeDtypeStructs carrying their shardings (ahead-of-time compilation for devices this
    process cannot use).
    """
    if plan is None:
        plan = make_plan(cfg, devices)
    family = models.get_family(cfg.model.family)
    # Before anything is traced: one error naming the family if the preset misses an axis.
    plan.check_names(sorted(family.logical_axes), f"model family {family.name!r}")
    for field, value, name in (
        ("model.num_heads", cfg.model.num_heads, "heads"),
        ("model.num_kv_heads", cfg.model.num_kv_heads, "kv_heads"),
    ):
        if name in family.logical_axes:
            plan.check_divides(field, value, name)
    tx = optim.build(
        cfg.optim, cfg.train.steps, freeze=cfg.train.freeze, param_names=param_names(cfg)
    )
    lr_schedule = optim.schedule(cfg.optim, cfg.train.steps)

    def create() -> tuple[TrainState, nnx.State[Any, Any]]:
        # flax types nnx.split with several filters as a variadic tuple of States.
        _, params, model_state, rest = nnx.split(create_model(cfg), nnx.Param, ModelState, ...)  # type: ignore[misc]
        key = jax.random.key_data(jax.random.key(cfg.train.seed + 1))
        step = jnp.zeros((), jnp.int32)
        return TrainState(step, params, tx.init(params), key, model_state), rest

    graphdef = nnx.split(nnx.eval_shape(lambda: create_model(cfg)), nnx.Param, ModelState, ...)[0]
    # Shardings come from the variables' logical names (checked against the rules here, before
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


def param_names(cfg: Config) -> optim.ParamNames:
    """A param's key path -> its "/"-joined unscanned name(s) (train.freeze matches them): a
    scan_layers stack holds one per layer, found with the family's stacked_path."""
    family = models.get_family(cfg.model.family)

    def names(keypath: tuple[Any, ...]) -> list[str]:
        keys = (getattr(k, "key", getattr(k, "idx", None)) for k in keypath)
        path: tuple[str | int, ...] = tuple(k for k in keys if k is not None)  # drops .value
        if path[:1] != ("stacks",) or family.stacked_path is None:
            return ["/".join(map(str, path))]
        unscanned = [("layers", i, *path[2:]) for i in range(cfg.model.num_layers)]
        held = [u for u in unscanned if family.stacked_path(cfg.model, u)[0] == path]
        return ["/".join(map(str, u)) for u in held]

    return names


def make_plan(cfg: Config, devices: list[jax.Device] | None = None) -> sharding_plan.Plan:
    """The sharding plan of cfg.sharding on `devices` (all of them by default), after checking
    the config fits that many devices."""
    num_devices = len(devices) if devices is not None else jax.device_count()
    config_lib.validate_for_devices(cfg, num_devices)
    return sharding_plan.make_plan(cfg.sharding, devices)


def params_target(
    cfg: Config, plan: sharding_plan.Plan, kind: Any = nnx.Param
) -> checkpoint.ParamsTarget:
    """What `checkpoint.load_params` restores a checkpoint's params onto for a run of cfg on
    plan: the model's abstract params on the plan's shardings, in either layer layout; with
    kind=ModelState its model state instead (`checkpoint.load_model_state`)."""
    family = models.get_family(cfg.model.family)
    return checkpoint.ParamsTarget.of_model(
        cfg,
        create_model,
        plan.shardings_for,
        stack_layers=family.stack_layers,
        unstack_layers=family.unstack_layers,
        kind=kind,
    )


def model_state_target(cfg: Config, plan: sharding_plan.Plan) -> checkpoint.ParamsTarget:
    """`params_target` for the model's models.ModelState variables."""
    return params_target(cfg, plan, kind=ModelState)


def initial_model_state(cfg: Config, plan: sharding_plan.Plan) -> nnx.State[Any, Any]:
    """The model state a new model of cfg starts with (e.g. moe.initial_bias), on the plan's
    shardings, without allocating the params (jit drops their initialisation)."""
    abstract = model_state_target(cfg, plan).abstract(cfg.model.scan_layers)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    state: nnx.State[Any, Any] = jax.jit(
        lambda: nnx.state(create_model(cfg), ModelState), out_shardings=shardings
    )()
    return state


def create_model(cfg: Config) -> nnx.Module:
    """The model of cfg, its params drawn from train.seed."""
    return models.build(cfg.model, cfg.moe, cfg.kernels, rngs=nnx.Rngs(params=cfg.train.seed))


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
        # The whole state is an argument (kept though only the params and the model state are
        # read) so that the program's memory analysis counts everything resident while it runs.
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


def jit_eval_step(b: Built) -> Any:
    """eval_step(params, batch, model_state) -> eval metrics (program/step.py make_eval_step),
    split into train.grad_accum_steps micro-batches like the train step, on the plan's
    shardings. It traces on its first call: call it under `b.plan.rules()`."""
    eval_step = make_eval_step(b.graphdef, b.rest, b.cfg.train.grad_accum_steps, b.batch_sharding)
    shardings = b.state_shardings
    return jax.jit(
        eval_step, in_shardings=(shardings.params, b.batch_sharding, shardings.model_state)
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

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        grads, losses = self.gradient(state, batch)
        out: tuple[TrainState, Metrics] = self.update(state, grads, losses)
        return out

    def lower(self, state: TrainState, batch: Batch) -> TwoPrograms:
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
