"""Public grouped matmul: `gmm` and `tgmm`, differentiable through one custom_vjp.

Legend: M rows (tokens sorted by group), K contraction, N outputs, G groups (G_local on an
expert-parallel shard, serving groups [group_offset, group_offset + G_local)).

The custom_vjp is written once over the backend protocol:
  dlhs = gmm(dout, rhs, transpose_rhs flipped), drhs = tgmm(lhs, dout).
A backend that must own its autodiff (fp8.QuantizedGmm keeps FP8 residuals, not the inputs)
defines `differentiable_gmm` / `differentiable_tgmm` with the protocol's gmm / tgmm signature;
gmm() / tgmm() then call those instead of wrapping the backend in this custom_vjp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moetext.kernels.gmm.backend import GmmBackend, Tiling, get_backend
from moetext.kernels.gmm.gather import Gather, check_gather, gather_weight, gathered_shape

TilingArg = Tiling | Callable[..., Tiling] | None


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: str | GmmBackend = "auto",
    preferred_element_type: jnp.dtype | None = None,
    transpose_rhs: bool = False,
    group_offset: jax.Array | int | None = None,
    tiling: TilingArg = None,
    existing_out: jax.Array | None = None,
    checked: bool = False,
    rhs_gather: Gather | None = None,
    grad_reduce_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """out[rows of g] = lhs[rows of g] @ rhs[g - group_offset] for the local groups g.

    lhs [M, K]; rhs [G_local, K, N] ([G_local, N, K] when transpose_rhs); group_sizes [G] int.
    Rows of group g are the consecutive block after groups 0..g-1. Rows of non-local groups and
    rows past sum(group_sizes) are zero, or taken from `existing_out` [M, N] when given.
    preferred_element_type defaults to lhs.dtype.

    rhs_gather (inside shard_map): rhs is this shard's slice of the weights, split along the
    given (dim, mesh axes) pairs (kernels/gmm/gather.py). It is cast to lhs.dtype and
    all-gathered (a backend may gather it its own way: fp8 QAG), and its gradient is
    reduce-scattered back to the slice, in `grad_reduce_dtype` (default: rhs's own dtype), and
    returned in rhs's dtype. Shapes above are the gathered ones.
    """
    be = get_backend(backend)
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    m, k = _check_2d("gmm", "lhs", lhs)
    if rhs.ndim != 3:
        raise ValueError(f"gmm: rhs must be [G, K, N] (rank 3), got shape {rhs.shape}")
    rhs_gather = check_gather(rhs_gather, rhs.ndim)
    shape = gathered_shape(rhs.shape, rhs_gather)
    g_local = shape[0]
    rk, n = (shape[2], shape[1]) if transpose_rhs else (shape[1], shape[2])
    if rk != k:
        layout = "[G, N, K] (transpose_rhs=True)" if transpose_rhs else "[G, K, N]"
        gathered = f" (gathered from {rhs.shape} by {rhs_gather})" if rhs_gather else ""
        raise ValueError(
            f"gmm: contraction mismatch: lhs {lhs.shape} has K={k} but rhs {shape}{gathered} "
            f"read as {layout} has K={rk}"
        )
    group_sizes, group_offset = _check_groups("gmm", group_sizes, g_local, group_offset)
    if existing_out is not None and existing_out.shape != (m, n):
        raise ValueError(f"gmm: existing_out must be {(m, n)}, got {existing_out.shape}")
    if checked:
        _runtime_check(group_sizes, m)
    pet = jnp.dtype(preferred_element_type or lhs.dtype)
    tiling = _resolve(tiling)
    kw = dict(
        preferred_element_type=pet,
        transpose_rhs=transpose_rhs,
        group_offset=group_offset,
        tiling=tiling,
    )
    own_gather = getattr(be, "differentiable_gathered_gmm", None)  # fp8 QAG
    if rhs_gather and own_gather is not None:
        return _existing(
            own_gather(
                lhs,
                rhs,
                group_sizes,
                gather=rhs_gather,
                grad_reduce_dtype=grad_reduce_dtype,
                **kw,
            ),
            existing_out,
            group_sizes,
            group_offset,
            g_local,
        )
    if rhs_gather:
        rhs = gather_weight(rhs, rhs_gather, lhs.dtype, grad_reduce_dtype)
    own = getattr(be, "differentiable_gmm", None)  # a backend that owns its autodiff (FP8)
    if own is not None:
        out = own(lhs, rhs, group_sizes, **kw)
    else:
        out = _gmm(be, pet, transpose_rhs, tiling, lhs, rhs, group_sizes, group_offset)
    return _existing(out, existing_out, group_sizes, group_offset, g_local)


def _existing(out, existing_out, group_sizes, group_offset, g_local: int):
    if existing_out is None:
        return out
    mine = local_row_mask(group_sizes, group_offset, g_local, out.shape[0])
    return jnp.where(mine[:, None], out, existing_out.astype(out.dtype))


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    num_groups: int | None = None,
    backend: str | GmmBackend = "auto",
    preferred_element_type: jnp.dtype | None = None,
    group_offset: jax.Array | int | None = None,
    tiling: TilingArg = None,
    checked: bool = False,
) -> jax.Array:
    """out[g] = lhs[rows of g].T @ rhs[rows of g]; lhs [M, K], rhs [M, N] -> [G_local, K, N].

    num_groups (G_local) defaults to len(group_sizes); empty groups give zeros.
    """
    be = get_backend(backend)
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    m, k = _check_2d("tgmm", "lhs", lhs)
    m2, n = _check_2d("tgmm", "rhs", rhs)
    if m2 != m:
        raise ValueError(f"tgmm: lhs {lhs.shape} and rhs {rhs.shape} must have the same rows M")
    g_total = _group_count("tgmm", group_sizes)
    num_groups = g_total if num_groups is None else int(num_groups)
    group_sizes, group_offset = _check_groups("tgmm", group_sizes, num_groups, group_offset)
    if checked:
        _runtime_check(group_sizes, m)
    pet = jnp.dtype(preferred_element_type or lhs.dtype)
    tiling = _resolve(tiling)
    own = getattr(be, "differentiable_tgmm", None)
    if own is not None:
        return own(
            lhs,
            rhs,
            group_sizes,
            num_groups=num_groups,
            preferred_element_type=pet,
            group_offset=group_offset,
            tiling=tiling,
        )
    return _tgmm(be, pet, num_groups, tiling, lhs, rhs, group_sizes, group_offset)


def local_row_mask(group_sizes, group_offset, num_local: int, m: int) -> jax.Array:
    """[M] bool: rows that belong to groups [group_offset, group_offset + num_local)."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = starts[group_offset]
    hi = ends[jnp.minimum(group_offset + num_local, group_sizes.shape[0]) - 1]
    rows = jnp.arange(m)
    return (rows >= lo) & (rows < hi)


# --- autodiff ---------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gmm(be, pet, transpose_rhs, tiling, lhs, rhs, group_sizes, group_offset):
    return be.gmm(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=pet,
        transpose_rhs=transpose_rhs,
        group_offset=group_offset,
        tiling=tiling,
    )


def _gmm_fwd(be, pet, transpose_rhs, tiling, lhs, rhs, group_sizes, group_offset):
    out = _gmm(be, pet, transpose_rhs, tiling, lhs, rhs, group_sizes, group_offset)
    return out, (lhs, rhs, group_sizes, group_offset)


def _gmm_bwd(be, pet, transpose_rhs, tiling, res, dout):
    lhs, rhs, group_sizes, group_offset = res
    dlhs = be.gmm(
        dout,
        rhs,
        group_sizes,
        preferred_element_type=lhs.dtype,
        transpose_rhs=not transpose_rhs,
        group_offset=group_offset,
        tiling=tiling,
    )
    a, b = (dout, lhs) if transpose_rhs else (lhs, dout)
    drhs = be.tgmm(
        a,
        b,
        group_sizes,
        num_groups=rhs.shape[0],
        preferred_element_type=rhs.dtype,
        group_offset=group_offset,
        tiling=tiling,
    )
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _tgmm(be, pet, num_groups, tiling, lhs, rhs, group_sizes, group_offset):
    return be.tgmm(
        lhs,
        rhs,
        group_sizes,
        num_groups=num_groups,
        preferred_element_type=pet,
        group_offset=group_offset,
        tiling=tiling,
    )


def _tgmm_fwd(be, pet, num_groups, tiling, lhs, rhs, group_sizes, group_offset):
    out = _tgmm(be, pet, num_groups, tiling, lhs, rhs, group_sizes, group_offset)
    return out, (lhs, rhs, group_sizes, group_offset)


def _tgmm_bwd(be, pet, num_groups, tiling, res, dout):
    # out[g] = lhs_g.T @ rhs_g  =>  dlhs_g = rhs_g @ dout[g].T,  drhs_g = lhs_g @ dout[g]
    lhs, rhs, group_sizes, group_offset = res
    dlhs = be.gmm(
        rhs,
        dout,
        group_sizes,
        preferred_element_type=lhs.dtype,
        transpose_rhs=True,
        group_offset=group_offset,
        tiling=tiling,
    )
    drhs = be.gmm(
        lhs,
        dout,
        group_sizes,
        preferred_element_type=rhs.dtype,
        transpose_rhs=False,
        group_offset=group_offset,
        tiling=tiling,
    )
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None, None


_tgmm.defvjp(_tgmm_fwd, _tgmm_bwd)


# --- input checks -----------------------------------------------------------------------------


def _check_2d(op: str, name: str, x) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"{op}: {name} must be rank 2, got shape {x.shape}")
    return x.shape


def _group_count(op: str, group_sizes) -> int:
    if group_sizes.ndim != 1:
        raise ValueError(f"{op}: group_sizes must be rank 1 [G], got shape {group_sizes.shape}")
    return group_sizes.shape[0]


def _check_groups(op: str, group_sizes, num_local: int, group_offset):
    g = _group_count(op, group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{op}: group_sizes must be integer, got dtype {group_sizes.dtype}")
    if group_offset is None:
        if num_local != g:
            raise ValueError(
                f"{op}: {num_local} groups in the weights but group_sizes has {g} entries "
                f"(pass group_offset for an expert-parallel shard holding a subset)"
            )
        group_offset = jnp.zeros((), jnp.int32)
    elif num_local > g:
        raise ValueError(f"{op}: {num_local} local groups exceed the {g} groups in group_sizes")
    group_offset = jnp.asarray(group_offset, jnp.int32)
    if group_offset.ndim != 0:
        raise ValueError(f"{op}: group_offset must be a scalar, got shape {group_offset.shape}")
    return group_sizes.astype(jnp.int32), group_offset


def _resolve(tiling: TilingArg):
    if tiling is None or callable(tiling):
        return tiling
    tiles = tuple(int(t) for t in tiling)
    if len(tiles) != 3 or min(tiles) <= 0:
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn), got {tiling}")
    return tiles


def _runtime_check(group_sizes, m: int) -> None:
    def check(gs):
        gs = np.asarray(gs)
        if (gs < 0).any() or gs.sum() > m:
            raise ValueError(
                f"group_sizes must be non-negative and sum to at most M={m}; got {gs.tolist()} "
                f"(sum {int(gs.sum())})"
            )

    jax.debug.callback(check, group_sizes)
