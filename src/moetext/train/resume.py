"""Where a run starts: the newest usable checkpoint (train state and data position restored),
else a fresh state, with checkpoint.load_params_from another checkpoint's params."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
from etils import epath

from moetext import checkpoint as checkpoint_lib
from moetext import data as data_lib
from moetext.checkpoint import Checkpointer, CheckpointError, abstract_like
from moetext.config import Config
from moetext.program import Built, TrainState, model_state_target, params_target
from moetext.train import rundir


def checkpointer(cfg: Config, run_dir: epath.Path, state: TrainState) -> Checkpointer | None:
    """The run's checkpointer (None with checkpoint.enabled=false); warns on stderr when the
    filesystem lacks room for checkpoint.keep + 1 checkpoints of `state`."""
    if not cfg.checkpoint.enabled:
        return None
    ckpt = Checkpointer(cfg.checkpoint, run_dir)
    if jax.process_index() == 0:
        size = rundir.state_bytes(state)
        if warning := rundir.free_space_warning(run_dir, size, cfg.checkpoint.keep):
            print(warning, file=sys.stderr, flush=True)
    return ckpt


def initial_state(b: Built, ckpt: Checkpointer | None, data: data_lib.TrainData) -> TrainState:
    """The resumed state, else b.state, its params replaced by checkpoint.load_params_from's."""
    state = _maybe_resume(b, ckpt, data)
    if state is b.state and b.cfg.checkpoint.load_params_from:
        # A new run from another checkpoint's params: free the random ones first (the loaded
        # ones take their place on every device), keep the fresh optimizer state and step 0.
        # The model state (a router's selection bias) comes with the params when the source
        # has it: it decides the routing the params were trained with.
        jax.tree.map(lambda x: x.delete(), state.params)
        src = b.cfg.checkpoint.load_params_from
        params = checkpoint_lib.load_params(src, b.cfg, params_target(b.cfg, b.plan))
        target = model_state_target(b.cfg, b.plan)
        model_state = checkpoint_lib.load_model_state(src, b.cfg, target)
        if model_state is None:
            model_state = state.model_state
        state = dataclasses.replace(state, params=params, model_state=model_state)
        b.state = state
        if jax.process_index() == 0:
            print(f"params from {src}", file=sys.stderr, flush=True)
    return state


def _maybe_resume(b: Built, ckpt: Checkpointer | None, data: data_lib.TrainData) -> TrainState:
    """The newest usable checkpoint's state (data position restored), else the fresh state."""
    if ckpt is None or not b.cfg.checkpoint.resume:
        return b.state
    directory, changes = ckpt.directory, {}

    def check_meta(step: int, meta: dict[str, Any]) -> None:  # before any array is read
        where = f"checkpoint {directory}/{step}"
        changes[step] = checkpoint_lib.check_config(meta.get("config"), b.cfg, where)
        check_model_state(directory / str(step), b.state, where)

    found = ckpt.restore_latest(abstract_like(b.state), check_meta)
    if found is None:
        return b.state
    step, restored, _, data_states = found
    state: TrainState = restored
    if changes[step] and jax.process_index() == 0:
        print(f"resume: checkpoint {directory}/{step}: {'; '.join(changes[step])}", file=sys.stderr)
    data.restore(data_states)
    return state


def check_model_state(step_dir: epath.Path, state: TrainState, where: str) -> None:
    """CheckpointError when the checkpoint and the model disagree on having model state (saved
    before the model had ModelState variables, or after it dropped them), before orbax's
    structure mismatch would set the checkpoint aside as unusable. A state/ item whose metadata
    cannot be read is left to the restore (which reports it and falls back)."""
    try:
        saved = "model_state" in checkpoint_lib.saved_items(step_dir)
    except Exception:  # orbax raises many types for a damaged item
        return
    wanted = len(state.model_state) > 0
    if saved == wanted:
        return
    held = "holds model_state" if saved else "holds no model_state"
    model = "has none" if saved else f"has {', '.join(sorted(map(str, state.model_state)))}"
    raise CheckpointError(
        f"{where} {held}, but this run's model {model} (models.ModelState variables): it was "
        f"saved by a model of another version. Start a new run from its params instead: "
        f"checkpoint.load_params_from={step_dir} with another train.run_dir"
    )
