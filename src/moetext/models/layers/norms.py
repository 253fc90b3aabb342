"""RMSNorm over the last axis, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.models.layers.params import make_param, ones


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    # float32 statistics: bf16 sums of squares lose the small components that RMSNorm rescales.
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale; scale [dim] initialised to ones."""

    def __init__(self, dim: int, *, eps: float, param_dtype: DTypeLike, rngs: nnx.Rngs):
        self.eps = float(eps)
        self.scale = make_param(rngs, ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)
