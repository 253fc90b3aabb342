"""What is compiled, shared by training, ahead-of-time compilation, decoding and benchmarks.

    b = program.build(cfg)                       # model -> TrainState, sharded by the plan
    step = program.jit_train_step(b)             # jitted (or two programs: TwoPrograms)
    batch = program.put_batch(rows, b.batch_sharding)
    state, metrics = program.lower_checked(b, step, b.state, batch).compile()(b.state, batch)

build.py builds the model, the plan and the jitted steps; step.py holds the train and eval
steps (loss, gradient, optimizer update, model-state update); loss.py the training objective;
state.py the TrainState; batch.py batch placement; `params_target` what a params-only
checkpoint read restores onto. Nothing here knows the training loop (moetext.train) or its
metrics.
"""

from moetext.program.batch import abstract_batch, local_rows, put_batch
from moetext.program.build import (
    Built,
    TwoPrograms,
    build,
    create_model,
    initial_model_state,
    jit_eval_step,
    jit_train_step,
    lower_checked,
    make_plan,
    model_state_target,
    params_target,
)
from moetext.program.state import TrainState

__all__ = [
    "Built",
    "TrainState",
    "TwoPrograms",
    "abstract_batch",
    "build",
    "create_model",
    "jit_eval_step",
    "jit_train_step",
    "local_rows",
    "lower_checked",
    "make_plan",
    "initial_model_state",
    "model_state_target",
    "params_target",
    "put_batch",
]
