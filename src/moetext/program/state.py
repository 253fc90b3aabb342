"""Train state: everything a checkpoint must hold to resume bit-exactly.

On disk (checkpoint `state/`) it is a tree of step, params, opt_state, rng and, for a model
with ModelState variables, model_state: each field's name is its key, and model_state's
subtree is the model's ModelState variables by their module path, as params' is the model's
Params (nnx.State). A model without ModelState has no model_state key at all: its checkpoints
are laid out as before the train state had one, so either kind restores into the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import optax
from flax import nnx
from jax.tree_util import GetAttrKey

_ALWAYS = ("step", "params", "opt_state", "rng")


@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken (also the data position)
    params: nnx.State[Any, Any]  # nnx.Param leaves of the model: what the optimizer updates
    opt_state: optax.OptState
    rng: jax.Array  # uint32 raw key data, for any training-time randomness
    # models.ModelState leaves (a router's selection bias, counters): read by the forward, never
    # differentiated or seen by the optimizer, updated by the step after the optimizer update
    # (models.ModelStateLM). An empty nnx.State for a model without any.
    model_state: nnx.State[Any, Any] = dataclasses.field(default_factory=lambda: nnx.State({}))

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def _has_model_state(s: TrainState) -> bool:
    return not (isinstance(s.model_state, nnx.State) and len(s.model_state) == 0)


def _flatten_with_keys(s: TrainState) -> tuple[Iterable[tuple[GetAttrKey, Any]], bool]:
    names = (*_ALWAYS, "model_state") if _has_model_state(s) else _ALWAYS
    return [(GetAttrKey(n), getattr(s, n)) for n in names], _has_model_state(s)


def _flatten(s: TrainState) -> tuple[Iterable[Any], bool]:
    names = (*_ALWAYS, "model_state") if _has_model_state(s) else _ALWAYS
    return [getattr(s, n) for n in names], _has_model_state(s)


def _unflatten(has_model_state: bool, children: Iterable[Any]) -> TrainState:
    names = (*_ALWAYS, "model_state") if has_model_state else _ALWAYS
    return TrainState(**dict(zip(names, children, strict=True)))


# A pytree whose keys are the field names (what orbax names the saved arrays by), leaving out an
# empty model_state: no node, so no `model_state` entry in a checkpoint that has nothing there.
jax.tree_util.register_pytree_with_keys(TrainState, _flatten_with_keys, _unflatten, _flatten)
