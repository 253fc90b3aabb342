"""Train state: everything a checkpoint must hold to resume bit-exactly."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken (also the data position)
    params: nnx.State[Any, Any]  # nnx.Param leaves of the model
    opt_state: optax.OptState
    rng: jax.Array  # uint32 raw key data, for any training-time randomness
