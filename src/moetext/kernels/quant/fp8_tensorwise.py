"""Recipe "fp8_tensorwise": per-tensor FP8 (current scaling) on any backend's own gmm / tgmm.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups (experts).

    op = Gmm(get_backend("ragged_dot"), Fp8Tensorwise())
    out = op(lhs, rhs, group_sizes)

One float32 scale per activation tensor (lhs, and the output gradient in the backward) and one
per expert weight matrix (rhs[l]): s = amax / max_finite, q = fp8(x / s). Because a scale covers
a whole operand of each per-group product, it factors out of the matmul:

    out[rows of g] = (x_q[rows] @ w_q[g]) * s_x * s_w[g]

so the FP8 values go straight into the backend's unmodified `gmm` / `tgmm` (float32
accumulation) and the scales are one multiply of the output rows. No scaled kernel is needed:
every backend runs it, and a backend on hardware that multiplies FP8 natively (tpu7x's MXU,
Hopper tensor cores) gets FP8 operands. One quantization of each operand serves the forward and
both backward matmuls (a per-tensor scale has no orientation), unlike block-wise scaling, which
must quantize activations along M and K separately. The price is range: one outlier shrinks the
resolution of its whole tensor (torchao's "tensorwise", TransformerEngine's current scaling).

Backward, all in FP8: the output gradient is quantized once (grad_dtype, e5m2 by default: range
matters more than mantissa for gradients under one scale) and
    dlhs[rows of g] = (d_q[rows] @ w_q[g].T) * s_d * s_w[g],  drhs[l] = (x_q.T @ d_q)_l * s_x * s_d.
The forward keeps x_q, w_q and their scales (1 byte per element), never a high-precision copy,
and activations kept outside a gmm (the SwiGLU inputs) are stored the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall
from moetext.kernels.gmm.recipe import Recipe, dlhs_call, static_vjp, tgmm_backward, tgmm_call
from moetext.kernels.quant.fp8_quantize import quantize_tensorwise

_FP8 = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Fp8Tensorwise(Recipe):
    """Per-tensor FP8 (fields are the recipe's options, `kernels.recipe.<field>` in a config).

    fwd_dtype: FP8 type of the forward operands (activations and weights).
    grad_dtype: FP8 type of the quantized output gradient.
    """

    name: ClassVar[str] = "fp8_tensorwise"

    fwd_dtype: str = "float8_e4m3fn"
    grad_dtype: str = "float8_e5m2"

    def __post_init__(self) -> None:
        for field in ("fwd_dtype", "grad_dtype"):
            value = getattr(self, field)
            try:
                name = jnp.dtype(value).name
            except TypeError:
                name = str(value)
            if name not in _FP8:
                raise ValueError(f"fp8_tensorwise: {field} must be one of {_FP8}, got {value!r}")
            object.__setattr__(self, field, name)

    def gmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _gmm(self._static(backend, lhs, rhs), lhs, rhs, sizes, call)

    def tgmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _tgmm(self._static(backend, lhs, rhs), lhs, rhs, sizes, call)

    def _static(self, backend: GmmBackend, lhs: jax.Array, rhs: jax.Array) -> _Static:
        return _Static(self, backend, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))

    def store_residual(self, backend: GmmBackend, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Activations kept outside a gmm (the SwiGLU inputs) as FP8 with one scale, like the
        gmm's own."""
        del backend
        return quantize_tensorwise(x, dtype=self.fwd_dtype)

    def load_residual(self, stored: Any, dtype: DTypeLike) -> jax.Array:
        q, scale = cast(tuple[jax.Array, jax.Array], stored)
        return (q.astype(jnp.float32) * scale).astype(dtype)


class _Static(NamedTuple):
    """The custom_vjps' static argument; the per-call options travel in their GmmCall."""

    recipe: Fp8Tensorwise
    backend: GmmBackend
    lhs_dtype: jnp.dtype
    rhs_dtype: jnp.dtype


def _row_scale(
    scale_L11: jax.Array, group_sizes: jax.Array, group_offset: jax.Array, m: int
) -> jax.Array:
    """[M, 1]: each row's expert weight scale. Rows outside the local groups get some local
    expert's scale; the backend already zeroed them."""
    group_M = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    local_M = jnp.clip(group_M - group_offset, 0, scale_L11.shape[0] - 1)
    return scale_L11[local_M, 0]


# --- gmm ---------------------------------------------------------------------------------------

# lhs_q, s_lhs [1, 1], rhs_q, s_rhs [L, 1, 1], group_sizes, call
_Res = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, GmmCall]
_F32 = jnp.dtype(jnp.float32)


def _gmm_fwd(
    s: _Static, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, _Res]:
    xq, sx = quantize_tensorwise(lhs, dtype=s.recipe.fwd_dtype)
    wq, sw = quantize_tensorwise(rhs, axes=(1, 2), dtype=s.recipe.fwd_dtype)
    acc = s.backend.gmm(xq, wq, group_sizes, call.replace(out_dtype=_F32))
    out = acc * (sx * _row_scale(sw, group_sizes, call.group_offset, acc.shape[0]))
    return out.astype(call.out_dtype), (xq, sx, wq, sw, group_sizes, call)


def _gmm_bwd(s: _Static, res: _Res, dout: jax.Array) -> tuple[Any, ...]:
    xq, sx, wq, sw, group_sizes, call = res
    dq, sd = quantize_tensorwise(dout, dtype=s.recipe.grad_dtype)
    dlhs = s.backend.gmm(dq, wq, group_sizes, dlhs_call(call, _F32))
    dlhs = dlhs * (sd * _row_scale(sw, group_sizes, call.group_offset, dlhs.shape[0]))
    a, b = (dq, xq) if call.transpose_rhs else (xq, dq)
    drhs = s.backend.tgmm(a, b, group_sizes, tgmm_call(call, wq.shape[0], _F32))
    drhs = drhs * (sx * sd)
    return dlhs.astype(s.lhs_dtype), drhs.astype(s.rhs_dtype), None, None


_gmm = static_vjp(_gmm_fwd, _gmm_bwd)


# --- tgmm (the weight-gradient shape as a forward op) ------------------------------------------

# lhs_q, s_lhs, rhs_q, s_rhs, group_sizes, call
_TRes = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, GmmCall]


def _tgmm_fwd(
    s: _Static, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, _TRes]:
    xq, sx = quantize_tensorwise(lhs, dtype=s.recipe.fwd_dtype)
    yq, sy = quantize_tensorwise(rhs, dtype=s.recipe.fwd_dtype)
    acc = s.backend.tgmm(xq, yq, group_sizes, call.replace(out_dtype=_F32))
    return (acc * (sx * sy)).astype(call.out_dtype), (xq, sx, yq, sy, group_sizes, call)


def _tgmm_bwd(s: _Static, res: _TRes, dout: jax.Array) -> tuple[Any, ...]:
    # tgmm is itself the weight gradient of gmm; its own gradient (second order) runs at the
    # input precision on the dequantized FP8 residuals, as fp8_blockwise's does.
    xq, sx, yq, sy, group_sizes, call = res
    x = (xq.astype(jnp.float32) * sx).astype(s.lhs_dtype)
    y = (yq.astype(jnp.float32) * sy).astype(s.rhs_dtype)
    grads = tgmm_backward(s.backend, x, y, group_sizes, call, dout, cast_dout=True)
    return (*grads, None, None)


_tgmm = static_vjp(_tgmm_fwd, _tgmm_bwd)
