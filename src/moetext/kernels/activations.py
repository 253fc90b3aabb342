"""SwiGLU for the expert MLP, with a backward that keeps only the two inputs.

    h = swiglu(g, u, backend=backend)          # silu(g) * u, g and u [M, F]

JAX's own autodiff of `silu(g) * u` keeps five [M, F] arrays for the backward (g, u, the
sigmoid, silu(g) and a product), which at Qwen3-30B-A3B shapes outweighs every gmm residual of
the layer (docs/performance.md, "FP8"). This custom_vjp keeps g and u and recomputes the rest
in the backward, in float32. When the gmm backend quantizes (fp8.QuantizedGmm), g and u are
kept the way it keeps activations: FP8 values + block scales along F (DeepSeek-V3 caches its
SwiGLU inputs in FP8 the same way), so the layer's residuals shrink with the gmm's. The forward
is the plain `jax.nn.silu(g) * u` in the inputs' dtype either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moetext.kernels.gmm.backend import GmmBackend, get_backend


def swiglu(g: jax.Array, u: jax.Array, *, backend: str | GmmBackend | None = None) -> jax.Array:
    """silu(g) * u; the backward keeps g and u (quantized when `backend` quantizes residuals,
    i.e. defines `quantize_residual(x) -> Quantized`)."""
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate {g.shape} and up {u.shape} must have the same shape")
    be = None if backend is None else get_backend(backend)
    quantize = getattr(be, "quantize_residual", None)
    return _swiglu(quantize, jnp.dtype(g.dtype), jnp.dtype(u.dtype), g, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _swiglu(quantize, g_dtype, u_dtype, g, u):
    return jax.nn.silu(g) * u


def _swiglu_fwd(quantize, g_dtype, u_dtype, g, u):
    res = (g, u) if quantize is None else (quantize(g), quantize(u))
    return _swiglu(quantize, g_dtype, u_dtype, g, u), res


def _swiglu_bwd(quantize, g_dtype, u_dtype, res, dh):
    g, u = res if quantize is None else (res[0].dequantize(g_dtype), res[1].dequantize(u_dtype))
    g32, u32, dh32 = (a.astype(jnp.float32) for a in (g, u, dh))
    sig = jax.nn.sigmoid(g32)
    dg = dh32 * u32 * sig * (1 + g32 * (1 - sig))  # d silu(g) / dg = s + g s (1 - s)
    du = dh32 * g32 * sig
    return dg.astype(g_dtype), du.astype(u_dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
