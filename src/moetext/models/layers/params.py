"""Parameter creation with logical axis names, and dtype names from the config.

Every parameter carries its logical axes (`out_sharding` metadata, read back with
`nnx.get_partition_spec`); the sharding layer maps them to mesh axes. Eager sharding is off so a
model builds on a laptop with no mesh; the trainer places parameters from the logical names.

`ModelState` is the other kind of model variable the trainer keeps: state that is not a
parameter (a router's selection bias, counters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(name: DTypeLike) -> jnp.dtype:
    """A config dtype name ("float32", "bfloat16", "float16") as a jnp dtype; a non-string
    (a dtype or scalar type such as jnp.bfloat16) goes through `jnp.dtype`."""
    if not isinstance(name, str):
        return jnp.dtype(name)
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid names: {', '.join(sorted(_DTYPES))}")
    return jnp.dtype(_DTYPES[name])


class ModelState(nnx.Variable[jax.Array]):
    """A model variable that is not a parameter: never differentiated, never seen by the
    optimizer or its weight decay. The train state carries it beside the params (sharded by its
    logical axes like them, saved in checkpoints as `model_state`); the forward reads it, and
    only the model's `update_model_state` (models.ModelStateLM), called by the train step after
    the optimizer update, changes it. Create one with `make_model_state`, which names its
    logical axes as `make_param` does a parameter's."""


def make_model_state(value: jax.Array, names: Sequence[str | None]) -> ModelState:
    """A ModelState holding `value`, annotated with logical axis `names` (() for a scalar)."""
    if len(names) != value.ndim:
        raise ValueError(
            f"logical names {tuple(names)} do not match model state shape {tuple(value.shape)}"
        )
    return ModelState(value, out_sharding=tuple(names), eager_sharding=False)


def make_param(
    rngs: nnx.Rngs,
    init: Callable[..., jax.Array],
    shape: Sequence[int],
    names: Sequence[str | None],
    param_dtype: DTypeLike,
) -> nnx.Param[jax.Array]:
    """An nnx.Param of `shape` initialised by `init`, annotated with logical axis `names`."""
    if len(names) != len(shape):
        raise ValueError(
            f"logical names {tuple(names)} do not match parameter shape {tuple(shape)}"
        )
    init = nnx.with_partitioning(init, sharding=tuple(names), eager_sharding=False)
    return nnx.Param(init(rngs.params(), tuple(shape), param_dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype, std: float) -> jax.Array:
    # Drawn in float32 then cast, so a bf16 model starts from the rounded f32 weights. One jit
    # per shape (std is traced) keeps eager model construction to one compile per param shape.
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def normal(std: float) -> Callable[..., jax.Array]:
    """N(0, std^2) initialiser."""
    return lambda key, shape, dtype=jnp.float32: _normal(key, tuple(shape), jnp.dtype(dtype), std)


def ones(key: jax.Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def zeros(key: jax.Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)
