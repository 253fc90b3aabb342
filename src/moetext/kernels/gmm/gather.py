"""Weights that arrive sharded: all-gather them for a grouped matmul, reduce-scatter the gradient.

Inside `jax.shard_map` an FSDP-sharded expert weight is a local slice; `gmm(..., rhs_gather=g)`
takes that slice plus a `Gather`: the (dim, mesh axes) pairs along which the slice is split, in
the order they are gathered. The backward reduces the weight gradient with `psum_scatter` along
the same pairs in reverse order, so each shard ends up with the gradient of its own slice.
The reduction runs in the slice's dtype unless a `grad_reduce_dtype` is given (bfloat16 halves
the bytes and the full-size gradient buffer the reduction needs, at bf16 summation precision).

The plain path (`gather_weight`) casts the slice to the compute dtype first, so the wire carries
bf16 rather than f32 master weights, and reduce-scatters the gradient in the slice's own dtype
(f32 master weights get an f32 reduction). This is `Recipe.gathered_gmm`'s default; the
fp8_blockwise recipe with `qag=True` replaces it with a quantized all-gather (kernels/fp8/qag.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.typed_jax import psum_scatter

# ((dim, (mesh axis, ...)), ...): dims of a local slice split over mesh axes, gathered in order.
Gather = tuple[tuple[int, tuple[str, ...]], ...]


def check_gather(gather: Iterable[Any] | None, ndim: int) -> Gather:
    """Normalises a Gather and rejects malformed ones with the offending entry named."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for entry in gather or ():
        try:
            dim, axes = entry
        except (TypeError, ValueError):
            raise ValueError(
                f"rhs_gather entries must be (dim, mesh axes) pairs, got {entry!r}"
            ) from None
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not 0 <= int(dim) < ndim or not axes:
            raise ValueError(
                f"rhs_gather entry {entry!r}: dim must be in [0, {ndim}) with at least one mesh "
                f"axis"
            )
        out.append((int(dim), axes))
    dims = [d for d, _ in out]
    if len(set(dims)) != len(dims):
        raise ValueError(f"rhs_gather names a dim twice: {gather!r}")
    return tuple(out)


def gathered_shape(shape: tuple[int, ...], gather: Gather) -> tuple[int, ...]:
    """The full (gathered) shape of a local slice; must run where the mesh axes are bound."""
    full = list(shape)
    for dim, axes in gather:
        full[dim] *= math.prod(jax.lax.axis_size(a) for a in axes)
    return tuple(full)


def all_gather_dims(x: jax.Array, gather: Gather) -> jax.Array:
    for dim, axes in gather:
        x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def psum_scatter_dims(x: jax.Array, gather: Gather) -> jax.Array:
    """The transpose of all_gather_dims: reduce-scatter along the same dims in reverse order."""
    for dim, axes in reversed(gather):
        x = psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    return x


def reduce_scatter_grad(
    g: jax.Array, gather: Gather, reduce_dtype: DTypeLike | None, w_dtype: DTypeLike
) -> jax.Array:
    """A gathered weight's gradient -> this shard's slice: psum_scatter in reduce_dtype (None:
    w_dtype), returned in w_dtype."""
    rd = jnp.dtype(reduce_dtype or w_dtype)
    return psum_scatter_dims(g.astype(rd), gather).astype(w_dtype)


def gather_weight(
    w: jax.Array, gather: Gather, dtype: DTypeLike, reduce_dtype: DTypeLike | None = None
) -> jax.Array:
    """all_gather_dims(w.astype(dtype)); the gradient is psum_scatter'ed in reduce_dtype
    (default w.dtype) and returned in w.dtype."""
    if not gather:
        return w.astype(dtype)
    rd = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    out: jax.Array = _gather_cast(gather, jnp.dtype(dtype), jnp.dtype(w.dtype), rd, w)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather_cast(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    w: jax.Array,
) -> jax.Array:
    return all_gather_dims(w.astype(dtype), gather)


def _gather_cast_fwd(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    w: jax.Array,
) -> tuple[jax.Array, None]:
    out: jax.Array = _gather_cast(gather, dtype, w_dtype, reduce_dtype, w)
    return out, None


def _gather_cast_bwd(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    _: None,
    g: jax.Array,
) -> tuple[jax.Array]:
    return (reduce_scatter_grad(g, gather, reduce_dtype, w_dtype),)


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)
