"""Public grouped matmul: the built `Gmm` object, and `gmm` / `tgmm` as plain functions.

Legend: M rows (tokens sorted by group), K contraction, N outputs, G groups (G_local on an
expert-parallel shard, serving groups [group_offset, group_offset + G_local)).

    op = Gmm(get_backend("auto"))                      # or kernels.build_gmm(...) from names
    op = Gmm(get_backend("auto"), Fp8Blockwise())      # a quantization recipe around it
    out = op(lhs, rhs, group_sizes)                    # [M,K] x [G,K,N] -> [M,N]
    dw  = op.tgmm(lhs, dout, group_sizes)              # [M,K] x [M,N]   -> [G,K,N]

A `Gmm` is what a layer receives: the backend, the recipe, and the options every call of a
model shares (tiling, checked, grad_reduce_dtype, fuse_gate_up). It checks the inputs, handles
`rhs_gather` and `existing_out`, and hands the math to `recipe.gmm(backend, lhs, rhs,
group_sizes, call)`, which owns the autodiff (`recipe.NoQuantization`: the custom_vjp over the
backend protocol). `call` (backend.GmmCall) is the one object that carries the per-call options
(output dtype, group offset, tiling, transpose_rhs / num_groups) down to the backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall, Tiling, TilingArg, get_backend
from moetext.kernels.gmm.gather import (
    Gather,
    WeightGather,
    check_gather,
    gathered_shape,
    minor_swapped,
)
from moetext.kernels.gmm.recipe import NoQuantization, Recipe


@dataclasses.dataclass(frozen=True)
class Gmm:
    """One configured grouped matmul; hashable, so layers keep it as a static attribute.

    backend: the GmmBackend that multiplies. recipe: how operands and gradients are quantized
    around it (NoQuantization: not at all). tiling: (tm, tk, tn), a callable (m, k, n, dtype,
    chip) -> tiles, or None for each backend's default. checked: a runtime check that group
    sizes are non-negative and sum to at most M (`jax.debug.callback`; a ValueError eagerly, a
    JaxRuntimeError under jit). grad_reduce_dtype: the dtype in which gradients of sharded
    weights (`rhs_gather`) are reduce-scattered; None: the weight slice's own dtype.
    fuse_gate_up: a hint to gated-MLP callers (models/moe/experts.py: swiglu_mlp) to run gate
    and up as one gmm on [w_gate | w_up]. regather_weights: sharded weights (`rhs_gather`) are
    all-gathered again in the backward instead of kept from the forward (less memory, one more
    all-gather per call; recipes other than NoQuantization refuse it with a ValueError).
    """

    backend: GmmBackend
    recipe: Recipe = NoQuantization()
    tiling: TilingArg = None
    checked: bool = False
    grad_reduce_dtype: str | None = None
    fuse_gate_up: bool = False
    regather_weights: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.backend, GmmBackend):
            raise ValueError(
                f"Gmm: backend must be a GmmBackend (kernels/gmm/backend.py), got "
                f"{type(self.backend).__name__}; get_backend(name) makes one from a name"
            )
        if not isinstance(self.recipe, Recipe):
            raise ValueError(
                f"Gmm: recipe must be a Recipe (kernels/gmm/recipe.py), got "
                f"{type(self.recipe).__name__}"
            )
        object.__setattr__(self, "tiling", _resolve(self.tiling))
        if self.grad_reduce_dtype is not None:
            object.__setattr__(self, "grad_reduce_dtype", jnp.dtype(self.grad_reduce_dtype).name)

    @property
    def name(self) -> str:
        """The backend's name, inside the recipe's when it quantizes: fp8_blockwise[blocked]."""
        if not self.recipe.quantizes:
            return self.backend.name
        return f"{self.recipe.name}[{self.backend.name}]"

    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        group_sizes: ArrayLike,
        *,
        preferred_element_type: DTypeLike | None = None,
        transpose_rhs: bool = False,
        group_offset: ArrayLike | None = None,
        existing_out: jax.Array | None = None,
        rhs_gather: Gather | None = None,
        gather_jointly: bool = False,
        rows_covered: bool = False,
    ) -> jax.Array:
        """out[rows of g] = lhs[rows of g] @ rhs[g - group_offset] for the local groups g.

        lhs [M, K]; rhs [G_local, K, N] ([G_local, N, K] when transpose_rhs); group_sizes [G]
        int. Rows of group g are the consecutive block after groups 0..g-1. Rows of non-local
        groups and rows past sum(group_sizes) are zero, or taken from `existing_out` [M, N].
        preferred_element_type (the output dtype) defaults to lhs.dtype.

        rhs_gather (inside shard_map): rhs is this shard's slice of the weights, split along
        the given (dim, mesh axes) pairs (kernels/gmm/gather.py). The recipe all-gathers it
        (cast to lhs.dtype, or quantized: fp8 QAG) and reduce-scatters its gradient, returned
        in rhs's dtype. Shapes above are the gathered ones. gather_jointly: all-gather each
        dim's mesh axes in one collective rather than one axis at a time (the reduce-scatter
        stays per axis; `WeightGather.jointly`).

        rows_covered: the caller guarantees sum(group_sizes) == M with every group local (no
        group_offset, G_local == len(group_sizes)), e.g. a dropless dispatch that sorted all
        its M assignments; backends may then skip zeroing rows outside the groups (pallas_tpu
        writes no zeros buffer). Rows are undefined if the guarantee does not hold.
        """
        lhs, rhs, sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
        m, k = _check_2d("gmm", "lhs", lhs)
        if rhs.ndim != 3:
            raise ValueError(f"gmm: rhs must be [G, K, N] (rank 3), got shape {rhs.shape}")
        gather = check_gather(rhs_gather, rhs.ndim)
        shape = gathered_shape(rhs.shape, gather)
        g_local = shape[0]
        rk, n = (shape[2], shape[1]) if transpose_rhs else (shape[1], shape[2])
        if rk != k:
            layout = "[G, N, K] (transpose_rhs=True)" if transpose_rhs else "[G, K, N]"
            gathered = f" (gathered from {rhs.shape} by {gather})" if gather else ""
            raise ValueError(
                f"gmm: contraction mismatch: lhs {lhs.shape} has K={k} but rhs {shape}{gathered} "
                f"read as {layout} has K={rk}"
            )
        sizes, offset = _check_groups("gmm", sizes, g_local, group_offset)
        if existing_out is not None and existing_out.shape != (m, n):
            raise ValueError(f"gmm: existing_out must be {(m, n)}, got {existing_out.shape}")
        if rows_covered and (
            existing_out is not None or group_offset is not None or g_local != sizes.shape[0]
        ):
            raise ValueError(
                f"gmm: rows_covered=True needs every group local and no existing_out; got "
                f"{g_local} local of {sizes.shape[0]} groups, group_offset="
                f"{'given' if group_offset is not None else None}, existing_out="
                f"{'given' if existing_out is not None else None}"
            )
        call = self._call(
            lhs, sizes, m, offset, preferred_element_type, transpose_rhs=transpose_rhs
        ).replace(rows_covered=bool(rows_covered))
        if gather:
            swapped = None if transpose_rhs else minor_swapped(rhs.shape, gather)
            if swapped is not None:
                # The same matmul on the slice with its last two dims swapped: see minor_swapped.
                rhs, gather = jnp.swapaxes(rhs, 1, 2), swapped
                call = call.replace(transpose_rhs=not transpose_rhs)
            reduce_dtype = (
                None if self.grad_reduce_dtype is None else jnp.dtype(self.grad_reduce_dtype)
            )
            weights = WeightGather(
                gather, reduce_dtype, self.regather_weights, bool(gather_jointly)
            )
            out = self.recipe.gathered_gmm(self.backend, lhs, rhs, sizes, call, weights)
        else:
            out = self.recipe.gmm(self.backend, lhs, rhs, sizes, call)
        if existing_out is None:
            return out
        mine = local_row_mask(sizes, offset, g_local, m)
        return jnp.where(mine[:, None], out, existing_out.astype(out.dtype))

    def _call(
        self,
        lhs: jax.Array,
        sizes: jax.Array,
        m: int,
        offset: jax.Array,
        preferred_element_type: DTypeLike | None,
        *,
        transpose_rhs: bool = False,
        num_groups: int | None = None,
    ) -> GmmCall:
        """The checked group sizes' call: its output dtype (lhs's by default), group offset and
        tiling; with `checked`, a runtime check that the sizes are >= 0 and sum to at most m."""
        if self.checked:
            _runtime_check(sizes, m)
        return GmmCall(
            jnp.dtype(preferred_element_type or lhs.dtype),
            offset,
            self.tiling,
            transpose_rhs=bool(transpose_rhs),
            num_groups=num_groups,
        )

    def tgmm(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        group_sizes: ArrayLike,
        *,
        num_groups: int | None = None,
        preferred_element_type: DTypeLike | None = None,
        group_offset: ArrayLike | None = None,
    ) -> jax.Array:
        """out[g] = lhs[rows of g].T @ rhs[rows of g]; lhs [M, K], rhs [M, N] -> [G_local, K, N].

        num_groups (G_local) defaults to len(group_sizes); empty groups give zeros.
        """
        lhs, rhs, sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
        m, _ = _check_2d("tgmm", "lhs", lhs)
        m2, _ = _check_2d("tgmm", "rhs", rhs)
        if m2 != m:
            raise ValueError(f"tgmm: lhs {lhs.shape} and rhs {rhs.shape} must have the same rows M")
        g_total = _group_count("tgmm", sizes)
        num_local = g_total if num_groups is None else int(num_groups)
        sizes, offset = _check_groups("tgmm", sizes, num_local, group_offset)
        call = self._call(lhs, sizes, m, offset, preferred_element_type, num_groups=num_local)
        return self.recipe.tgmm(self.backend, lhs, rhs, sizes, call)

    def store_residual(self, x: jax.Array) -> Any:
        """An activation kept for the backward outside a gmm, as the recipe keeps its own (FP8
        values + scales under an FP8 recipe; x itself otherwise)."""
        return self.recipe.store_residual(self.backend, x)

    def load_residual(self, stored: Any, dtype: DTypeLike) -> jax.Array:
        return self.recipe.load_residual(stored, jnp.dtype(dtype))


def gmm(
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    backend: str | GmmBackend = "auto",
    preferred_element_type: DTypeLike | None = None,
    transpose_rhs: bool = False,
    group_offset: ArrayLike | None = None,
    tiling: TilingArg = None,
    existing_out: jax.Array | None = None,
    checked: bool = False,
    rhs_gather: Gather | None = None,
    gather_jointly: bool = False,
    grad_reduce_dtype: DTypeLike | None = None,
    rows_covered: bool = False,
) -> jax.Array:
    """One unquantized grouped matmul: `Gmm(get_backend(backend), tiling=tiling,
    checked=checked, grad_reduce_dtype=grad_reduce_dtype)(lhs, rhs, group_sizes, ...)`; the
    arguments are `Gmm`'s and `Gmm.__call__`'s."""
    gd = None if grad_reduce_dtype is None else jnp.dtype(grad_reduce_dtype).name
    op = Gmm(get_backend(backend), tiling=tiling, checked=checked, grad_reduce_dtype=gd)
    return op(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
        group_offset=group_offset,
        existing_out=existing_out,
        rhs_gather=rhs_gather,
        gather_jointly=gather_jointly,
        rows_covered=rows_covered,
    )


def tgmm(
    lhs: ArrayLike,
    rhs: ArrayLike,
    group_sizes: ArrayLike,
    *,
    num_groups: int | None = None,
    backend: str | GmmBackend = "auto",
    preferred_element_type: DTypeLike | None = None,
    group_offset: ArrayLike | None = None,
    tiling: TilingArg = None,
    checked: bool = False,
) -> jax.Array:
    """One unquantized transposed grouped matmul: `Gmm(get_backend(backend), tiling=tiling,
    checked=checked).tgmm(lhs, rhs, group_sizes, ...)`."""
    op = Gmm(get_backend(backend), tiling=tiling, checked=checked)
    return op.tgmm(
        lhs,
        rhs,
        group_sizes,
        num_groups=num_groups,
        preferred_element_type=preferred_element_type,
        group_offset=group_offset,
    )


def local_row_mask(
    group_sizes: jax.Array, group_offset: ArrayLike, num_local: int, m: int
) -> jax.Array:
    """[M] bool: rows that belong to groups [group_offset, group_offset + num_local)."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    lo = starts[group_offset]
    hi = ends[jnp.minimum(jnp.asarray(group_offset) + num_local, group_sizes.shape[0]) - 1]
    rows = jnp.arange(m)
    return (rows >= lo) & (rows < hi)


# --- input checks -----------------------------------------------------------------------------


def _check_2d(op: str, name: str, x: jax.Array) -> tuple[int, int]:
    if x.ndim != 2:
        raise ValueError(f"{op}: {name} must be rank 2, got shape {x.shape}")
    return x.shape[0], x.shape[1]


def _group_count(op: str, group_sizes: jax.Array) -> int:
    if group_sizes.ndim != 1:
        raise ValueError(f"{op}: group_sizes must be rank 1 [G], got shape {group_sizes.shape}")
    return int(group_sizes.shape[0])


def _check_groups(
    op: str, group_sizes: jax.Array, num_local: int, group_offset: ArrayLike | None
) -> tuple[jax.Array, jax.Array]:
    g = _group_count(op, group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{op}: group_sizes must be integer, got dtype {group_sizes.dtype}")
    if group_offset is None:
        if num_local != g:
            raise ValueError(
                f"{op}: {num_local} groups in the weights but group_sizes has {g} entries "
                f"(pass group_offset for an expert-parallel shard holding a subset)"
            )
        offset = jnp.zeros((), jnp.int32)
    elif num_local > g:
        raise ValueError(f"{op}: {num_local} local groups exceed the {g} groups in group_sizes")
    else:
        offset = jnp.asarray(group_offset, jnp.int32)
    if offset.ndim != 0:
        raise ValueError(f"{op}: group_offset must be a scalar, got shape {offset.shape}")
    return group_sizes.astype(jnp.int32), offset


def _resolve(tiling: TilingArg) -> TilingArg:
    if tiling is None or callable(tiling):
        return tiling
    try:
        tiles = tuple(int(t) for t in tiling)
    except (TypeError, ValueError):
        tiles = ()
    if len(tiles) != 3 or min(tiles) <= 0:
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn), got {tiling}")
    resolved: Tiling = (tiles[0], tiles[1], tiles[2])
    return resolved


def _runtime_check(group_sizes: jax.Array, m: int) -> None:
    def check(gs: Any) -> None:
        gs = np.asarray(gs)
        if (gs < 0).any() or gs.sum() > m:
            raise ValueError(
                f"group_sizes must be non-negative and sum to at most M={m}; got {gs.tolist()} "
                f"(sum {int(gs.sum())})"
            )

    jax.debug.callback(check, group_sizes)
