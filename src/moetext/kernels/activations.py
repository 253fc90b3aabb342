"""SwiGLU for the expert MLP, with a backward that keeps only the two inputs.

    h = swiglu(g, u, gmm=gmm)          # silu(g) * u, g and u [M, F]

JAX's own autodiff of `silu(g) * u` keeps five [M, F] arrays for the backward (g, u, the
sigmoid, silu(g) and a product), which at Qwen3-30B-A3B shapes outweighs every gmm residual of
the layer (docs/performance.md, "FP8"). This custom_vjp keeps g and u and recomputes the rest
in the backward, in float32. g and u are kept the way the layer's `Gmm` keeps activations
(`Gmm.store_residual`: FP8 values + block scales along F under fp8_blockwise, as DeepSeek-V3
caches its SwiGLU inputs), so the layer's residuals shrink with the gmm's. The forward is the
plain `jax.nn.silu(g) * u` in the inputs' dtype either way.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from moetext.kernels.gmm.api import Gmm


def swiglu(g: jax.Array, u: jax.Array, *, gmm: Gmm | None = None) -> jax.Array:
    """silu(g) * u; the backward keeps g and u (as `gmm.store_residual` stores them, when
    given; as they are otherwise)."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate {g.shape} and up {u.shape} must have the same shape")
    return _swiglu(gmm, jnp.dtype(g.dtype), jnp.dtype(u.dtype), g, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _swiglu(
    gmm: Gmm | None, g_dtype: jnp.dtype, u_dtype: jnp.dtype, g: jax.Array, u: jax.Array
) -> jax.Array:
    return jax.nn.silu(g) * u


def _swiglu_fwd(
    gmm: Gmm | None, g_dtype: jnp.dtype, u_dtype: jnp.dtype, g: jax.Array, u: jax.Array
) -> tuple[jax.Array, tuple[Any, Any]]:
    res = (g, u) if gmm is None else (gmm.store_residual(g), gmm.store_residual(u))
    return _swiglu(gmm, g_dtype, u_dtype, g, u), res


def _swiglu_bwd(
    gmm: Gmm | None,
    g_dtype: jnp.dtype,
    u_dtype: jnp.dtype,
    res: tuple[Any, Any],
    dh: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    g, u = (
        res
        if gmm is None
        else (gmm.load_residual(res[0], g_dtype), gmm.load_residual(res[1], u_dtype))
    )
    g32, u32, dh32 = (a.astype(jnp.float32) for a in (g, u, dh))
    sig = jax.nn.sigmoid(g32)
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))  # d silu(g) / dg = s + g s (1 - s)
    du = dh32 * g32 * sig
    return dg.astype(g_dtype), du.astype(u_dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
