"""SwiGLU for the expert MLP, with a backward that keeps only the two inputs (and the scale).

    h = swiglu(g, u, gmm=gmm)          # silu(g) * u, g and u [M, F]
    h = swiglu(g, u, scale=w_M)        # silu(g) * u * w_M[:, None] (the MoE routing weights)

JAX's own autodiff of `silu(g) * u` keeps five [M, F] arrays for the backward (g, u, the
sigmoid, silu(g) and a product), which at Qwen3-30B-A3B shapes outweighs every gmm residual of
the layer (docs/performance.md, "FP8"). This custom_vjp keeps g and u and recomputes the rest
in the backward, in float32. g and u are kept the way the layer's `Gmm` keeps activations
(`Gmm.store_residual`: FP8 values + block scales along F under fp8_blockwise, as DeepSeek-V3
caches its SwiGLU inputs), so the layer's residuals shrink with the gmm's. The forward is the
plain `jax.nn.silu(g) * u` in the inputs' dtype either way; with a per-row scale it is computed
in float32 and rounded once, and the backward keeps the scale too and returns its gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from moetext.kernels.gmm.api import Gmm


def swiglu(
    g: jax.Array, u: jax.Array, *, gmm: Gmm | None = None, scale: jax.Array | None = None
) -> jax.Array:
    """silu(g) * u; the backward keeps g and u (as `gmm.store_residual` stores them, when
    given; as they are otherwise).

    scale [M] (float32; g and u [M, F]): silu(g) * u * scale[:, None], computed in float32 and
    rounded once to g's dtype, differentiable in scale too (the backward keeps scale besides g
    and u, and forms d scale = sum_F dh * silu(g) * u in the same pass). The MoE layer scales
    each expert row by its routing weight here, before the down projection, rather than the
    projection's output in the combine (models/moe/experts.py: swiglu_mlp)."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate {g.shape} and up {u.shape} must have the same shape")
    if scale is not None and (g.ndim != 2 or scale.shape != g.shape[:1]):
        raise ValueError(
            f"swiglu: scale must be [M] = [{g.shape[0]}] for g and u [M, F], got scale "
            f"{scale.shape} and g {g.shape}"
        )
    return _swiglu(gmm, jnp.dtype(g.dtype), jnp.dtype(u.dtype), g, u, scale)


# scale is None (no scale: the plain product, no cotangent) or an [M] array.
_Res = tuple[Any, Any, jax.Array | None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _swiglu(
    gmm: Gmm | None,
    g_dtype: jnp.dtype,
    u_dtype: jnp.dtype,
    g: jax.Array,
    u: jax.Array,
    scale: jax.Array | None,
) -> jax.Array:
    if scale is None:
        return jax.nn.silu(g) * u
    f32 = jnp.float32
    h = jax.nn.silu(g.astype(f32)) * u.astype(f32) * scale.astype(f32)[:, None]
    return h.astype(g_dtype)


def _swiglu_fwd(
    gmm: Gmm | None,
    g_dtype: jnp.dtype,
    u_dtype: jnp.dtype,
    g: jax.Array,
    u: jax.Array,
    scale: jax.Array | None,
) -> tuple[jax.Array, _Res]:
    kept = (g, u) if gmm is None else (gmm.store_residual(g), gmm.store_residual(u))
    return _swiglu(gmm, g_dtype, u_dtype, g, u, scale), (*kept, scale)


def _swiglu_bwd(
    gmm: Gmm | None, g_dtype: jnp.dtype, u_dtype: jnp.dtype, res: _Res, dh: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    stored_g, stored_u, scale = res
    g, u = (
        (stored_g, stored_u)
        if gmm is None
        else (gmm.load_residual(stored_g, g_dtype), gmm.load_residual(stored_u, u_dtype))
    )
    g32, u32, dh32 = (a.astype(jnp.float32) for a in (g, u, dh))
    dscale = None
    if scale is not None:
        dscale = jnp.sum(dh32 * jax.nn.silu(g32) * u32, axis=1).astype(scale.dtype)
        dh32 = dh32 * scale.astype(jnp.float32)[:, None]
    sig = jax.nn.sigmoid(g32)
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))  # d silu(g) / dg = s + g s (1 - s)
    du = dh32 * g32 * sig
    return dg.astype(g_dtype), du.astype(u_dtype), dscale


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
