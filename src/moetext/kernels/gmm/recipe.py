"""The quantization-recipe protocol (`Recipe`) and the identity recipe (`NoQuantization`).

Legend: M rows (tokens sorted by group), K contraction, N outputs, G groups (G_local on an
expert-parallel shard, serving groups [group_offset, group_offset + G_local)).

A recipe says how a grouped matmul and its gradients are computed around any `GmmBackend`:
which operands are quantized and how, what the forward keeps for the backward, in which
precision the backward runs. It therefore owns the matmul's autodiff. `NoQuantization` is the
custom_vjp written once over the backend protocol:
  dlhs = gmm(dout, rhs, transpose_rhs flipped), drhs = tgmm(lhs, dout).
On a weight slice inside shard_map (`gathered_gmm`) the same backward reduce-scatters drhs a
tile at a time (gather.reduce_scatter_tiled), so the full-size weight gradient never exists.
The quantized recipes live in `moetext.kernels.quant` (one file each, one registry line).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall
from moetext.kernels.gmm.gather import (
    WeightGather,
    all_gather_dims,
    gather_weight,
    narrow,
    reduce_scatter_tiled,
)
from moetext.kernels.typed_jax import optimization_barrier


class Recipe(abc.ABC):
    """How a grouped matmul and its gradients run on (possibly quantized) operands.

    Required: `name` (the registry name), and differentiable `gmm` / `tgmm` taking the backend,
    the operands and the `GmmCall` the backend protocol takes (shapes already checked by
    `api.Gmm`).

    Optional hooks (defaults below):
      `quantizes`: False only for the identity; "auto" settings key off it.
      `gathered_gmm`: gmm on a weight slice inside shard_map; the default all-gathers it in
        the compute dtype first (a recipe may gather quantized values instead: fp8 QAG).
      `store_residual` / `load_residual`: how an activation kept for the backward outside a
        gmm (the SwiGLU inputs, kernels/activations.py) is stored; the default keeps it as is.

    Recipes are frozen dataclasses: they are static arguments of jit and custom_vjp.
    """

    name: ClassVar[str]
    quantizes: ClassVar[bool] = True

    @abc.abstractmethod
    def gmm(
        self,
        backend: GmmBackend,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [G_local, K, N] ([G_local, N, K] when call.transpose_rhs)
        group_sizes: jax.Array,  # [G] int32
        call: GmmCall,
    ) -> jax.Array:
        """[M, N], differentiable in lhs and rhs (gradients in their dtypes)."""

    @abc.abstractmethod
    def tgmm(
        self,
        backend: GmmBackend,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [M, N]
        group_sizes: jax.Array,
        call: GmmCall,  # call.num_groups = G_local
    ) -> jax.Array:
        """[G_local, K, N], differentiable in lhs and rhs."""

    def gathered_gmm(
        self,
        backend: GmmBackend,
        lhs: jax.Array,
        rhs: jax.Array,  # this shard's slice of the weights, split along `gather.dims`
        group_sizes: jax.Array,
        call: GmmCall,
        gather: WeightGather,
    ) -> jax.Array:
        """gmm on the all-gathered weights; the weight gradient is reduce-scattered back to the
        slice (in `gather.reduce_dtype`, default the slice's dtype) and returned in its dtype.
        gather.regather (gather the weights again in the backward instead of keeping the
        forward's copy) is NoQuantization's; this default path keeps the copy, so it refuses."""
        if gather.regather:
            raise ValueError(
                f"regather_weights is not implemented by the {self.name!r} recipe's gathered "
                f"gmm; it is by quantization 'none'"
            )
        full = gather_weight(rhs, gather.dims, lhs.dtype, gather.reduce_dtype, gather.jointly)
        return self.gmm(backend, lhs, full, group_sizes, call)

    def store_residual(self, backend: GmmBackend, x: jax.Array) -> Any:
        """What the backward keeps of activation x (a pytree); the default is x itself."""
        del backend
        return x

    def load_residual(self, stored: Any, dtype: DTypeLike) -> jax.Array:
        """x back from `store_residual`, in `dtype`."""
        return jnp.asarray(stored).astype(dtype)


@dataclasses.dataclass(frozen=True)
class NoQuantization(Recipe):
    """The identity recipe: the backend's matmuls at the input precision, autodiff by the
    custom_vjp over the protocol (so a backend only implements forward math)."""

    name: ClassVar[str] = "none"
    quantizes: ClassVar[bool] = False

    def gmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _grouped((backend, False), lhs, rhs, sizes, call)

    def tgmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _grouped((backend, True), lhs, rhs, sizes, call)

    def gathered_gmm(
        self,
        backend: GmmBackend,
        lhs: Array,
        rhs: Array,
        group_sizes: Array,
        call: GmmCall,
        gather: WeightGather,
    ) -> Array:
        """The default's math (gmm on the all-gathered weights), one custom_vjp over both: the
        weight gradient is computed and reduce-scattered a tile at a time. gather.regather: the
        backward gathers the weights again rather than keeping the forward's gathered copy."""
        return _gathered_gmm((backend, gather, jnp.dtype(rhs.dtype)), lhs, rhs, group_sizes, call)


def static_vjp(
    fwd: Callable[..., tuple[Array, Any]], bwd: Callable[..., tuple[Any, ...]]
) -> Callable[..., Array]:
    """f(static, *args) = fwd(static, *args)[0], differentiated by bwd(static, residuals, dout):
    the custom_vjp every recipe writes, with its first argument static (hashable)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def f(static: Any, *args: Any) -> Array:
        out: Array = fwd(static, *args)[0]
        return out

    f.defvjp(fwd, bwd)
    return f


# --- the custom_vjp over the backend protocol --------------------------------------------------

_Res = tuple[Array, Array, Array, GmmCall]  # lhs, rhs, group_sizes, call
_Grads = tuple[Array, Array, None, None]


def gmm_backward(
    be: GmmBackend, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall, dout: Array
) -> tuple[Array, Array]:
    """(dlhs, drhs) of out = gmm(lhs, rhs, call) on `be`: dlhs = gmm(dout, rhs, transpose_rhs
    flipped), drhs = tgmm(lhs, dout) (operands swapped when rhs is transposed), each in its
    operand's dtype."""
    dlhs = be.gmm(dout, rhs, group_sizes, dlhs_call(call, lhs.dtype))
    a, b = (dout, lhs) if call.transpose_rhs else (lhs, dout)
    drhs = be.tgmm(a, b, group_sizes, tgmm_call(call, rhs.shape[0], rhs.dtype))
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)


def tgmm_backward(
    be: GmmBackend,
    lhs: Array,
    rhs: Array,
    group_sizes: Array,
    call: GmmCall,
    dout: Array,
    *,
    cast_dout: bool = False,
) -> tuple[Array, Array]:
    """(dlhs, drhs) of out = tgmm(lhs, rhs, call) on `be`: out[g] = lhs_g.T @ rhs_g, so
    dlhs_g = rhs_g @ dout[g].T and drhs_g = lhs_g @ dout[g], each in its operand's dtype.
    cast_dout: dout is cast to the other operand's dtype first (the FP8 recipes' second-order
    gradient, on dequantized residuals)."""
    d_r, d_l = (dout.astype(rhs.dtype), dout.astype(lhs.dtype)) if cast_dout else (dout, dout)
    dlhs = be.gmm(rhs, d_r, group_sizes, gmm_call(call, lhs.dtype, transpose_rhs=True))
    drhs = be.gmm(lhs, d_l, group_sizes, gmm_call(call, rhs.dtype, transpose_rhs=False))
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype)


def gmm_call(call: GmmCall, out_dtype: DTypeLike, *, transpose_rhs: bool) -> GmmCall:
    """A gmm with `call`'s group offset, tiling and row coverage (a backward's dlhs)."""
    return GmmCall(
        jnp.dtype(out_dtype),
        call.group_offset,
        call.tiling,
        transpose_rhs,
        rows_covered=call.rows_covered,
    )


def dlhs_call(call: GmmCall, out_dtype: DTypeLike) -> GmmCall:
    """The gmm that gives dlhs of gmm(lhs, rhs, call): dout @ rhs with transpose_rhs flipped."""
    return gmm_call(call, out_dtype, transpose_rhs=not call.transpose_rhs)


def tgmm_call(call: GmmCall, num_groups: int, out_dtype: DTypeLike) -> GmmCall:
    """A tgmm with `call`'s group offset and tiling (a backward's drhs)."""
    return GmmCall(jnp.dtype(out_dtype), call.group_offset, call.tiling, num_groups=int(num_groups))


# static: (backend, transposed): the backend's gmm (False) or tgmm (True).
def _grouped_fwd(
    static: tuple[GmmBackend, bool], lhs: Array, rhs: Array, sizes: Array, call: GmmCall
) -> tuple[Array, _Res]:
    be, transposed = static
    out = (be.tgmm if transposed else be.gmm)(lhs, rhs, sizes, call)
    return out, (lhs, rhs, sizes, call)


def _grouped_bwd(static: tuple[GmmBackend, bool], res: _Res, dout: Array) -> _Grads:
    be, transposed = static
    return (*(tgmm_backward if transposed else gmm_backward)(be, *res, dout), None, None)


_grouped = static_vjp(_grouped_fwd, _grouped_bwd)


# --- gmm on all-gathered weight slices ---------------------------------------------------------

# (backend, the gather, the slice's dtype: f32 master weights)
_GatheredStatic = tuple[GmmBackend, WeightGather, jnp.dtype]


def _gathered_gmm_fwd(
    s: _GatheredStatic, lhs: Array, w: Array, group_sizes: Array, call: GmmCall
) -> tuple[Array, _Res]:
    be, gather, _ = s
    # The slice travels in the compute dtype (bf16 on the wire, not the f32 master weights).
    full = all_gather_dims(narrow(w, lhs.dtype), gather.dims, gather.jointly)
    out = be.gmm(lhs, full, group_sizes, call)
    # Keeping `full` holds one gathered weight per gmm from the forward (under remat: the
    # recomputed forward) to its backward, and XLA starts the next layer's gathers early, so
    # several are live at once; `regather` keeps only this shard's slice instead.
    return out, (lhs, w if gather.regather else full, group_sizes, call)


def _gathered_gmm_bwd(s: _GatheredStatic, res: _Res, dout: Array) -> _Grads:
    be, gather, w_dtype = s
    lhs, kept, group_sizes, call = res
    if gather.regather:
        # The barrier ties the gather to the backward (it needs dout) and keeps XLA from
        # merging it with the forward's identical gather, which would keep that copy alive.
        w, dout = optimization_barrier((kept, dout))
        full = all_gather_dims(narrow(w, lhs.dtype), gather.dims, gather.jointly)
    else:
        full = kept
    dlhs = be.gmm(dout, full, group_sizes, dlhs_call(call, lhs.dtype))
    a, b = (dout, lhs) if call.transpose_rhs else (lhs, dout)
    # As gmm_backward: the gradient of the gathered weight in its (compute) dtype.
    drhs_call = tgmm_call(call, full.shape[0], full.dtype)

    def drhs(a_cols: Array, b_cols: Array) -> Array:
        return be.tgmm(a_cols, b_cols, group_sizes, drhs_call)

    g, k, n = full.shape
    dw = reduce_scatter_tiled(drhs, a, b, (g, k, n), gather.dims, gather.reduce_dtype, w_dtype)
    return dlhs.astype(lhs.dtype), dw, None, None


_gathered_gmm = static_vjp(_gathered_gmm_fwd, _gathered_gmm_bwd)
