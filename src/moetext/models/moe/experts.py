"""E routed SwiGLU experts with stacked weights, computed grouped (dropless) or batched (capacity).

Legend: E experts, D emb_dim, F moe_intermediate_size, M sorted assignment rows, C capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.config.schema import KernelsConfig
from moetext.errors import ConfigError
from moetext.kernels import build_gmm
from moetext.kernels.activations import swiglu
from moetext.kernels.gmm import Gmm
from moetext.models.layers.params import make_param, normal

MatMul = Callable[[jax.Array, jax.Array], jax.Array]  # (lhs [M, K], w [E, K, N]) -> [M, N]


class Experts(nnx.Module):
    # [E, D, 2F] = [w_gate | w_up], only after moe.decode.prefuse (which deletes the two).
    w_gate_up: nnx.Param[jax.Array]
    # kernels.decode_moe of a prefused layer (set by moe.decode.prefuse).
    decode_kernel: str

    def __init__(
        self,
        num_experts: int,
        emb_dim: int,
        hidden_dim: int,
        *,
        init_std: float,
        param_dtype: DTypeLike,
        dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        init = normal(init_std)
        e, d, f = num_experts, emb_dim, hidden_dim
        self.w_gate = make_param(rngs, init, (e, d, f), ("exp", "embed", "mlp_moe"), param_dtype)
        self.w_up = make_param(rngs, init, (e, d, f), ("exp", "embed", "mlp_moe"), param_dtype)
        self.w_down = make_param(rngs, init, (e, f, d), ("exp", "mlp_moe", "embed"), param_dtype)

    def grouped(
        self,
        xs_MD: jax.Array,
        group_sizes_E: jax.Array,
        gmm: Gmm,
        row_scale: jax.Array | None = None,
    ) -> jax.Array:
        """Rows sorted by expert (group_sizes_E of them per expert, summing to M: every row is some
        expert's) through their expert's MLP (row_scale: as in `swiglu_mlp`)."""
        dt = self.dtype

        def mm(lhs: jax.Array, w: jax.Array) -> jax.Array:
            return gmm(lhs, w, group_sizes_E, preferred_element_type=dt, rows_covered=True)

        w_gate, w_up = (w.astype(dt) for w in self.gate_up())
        w_down = self.w_down[...].astype(dt)
        return swiglu_mlp(
            xs_MD.astype(dt), w_gate, w_up, w_down, mm, mm, gmm=gmm, row_scale=row_scale
        )

    def gate_up(self) -> tuple[jax.Array, jax.Array]:
        """(w_gate, w_up) [E, D, F], also after moe.decode.prefuse (halves of w_gate_up)."""
        if hasattr(self, "w_gate_up"):
            fused = self.w_gate_up[...]
            f = fused.shape[-1] // 2
            return fused[..., :f], fused[..., f:]
        return self.w_gate[...], self.w_up[...]

    def batched(self, x_ECD: jax.Array) -> jax.Array:
        """Fixed-capacity buffers [E, C, D] through their expert's MLP (plain einsums)."""
        dt = self.dtype
        x = x_ECD.astype(dt)
        w_gate, w_up = self.gate_up()
        gate_ECF = jnp.einsum("ecd,edf->ecf", x, w_gate.astype(dt))
        up_ECF = jnp.einsum("ecd,edf->ecf", x, w_up.astype(dt))
        h_ECF = swiglu(gate_ECF, up_ECF)
        return jnp.einsum("ecf,efd->ecd", h_ECF, self.w_down[...].astype(dt))


def swiglu_mlp(
    xs_MD: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    mm_in: MatMul,
    mm_out: MatMul,
    *,
    gmm: Gmm,
    gate_up_slices: int = 1,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """The SwiGLU expert MLP on rows grouped by expert.

    row_scale [M] (float32): each row's hidden activation is scaled by it before the down
    projection (`swiglu(..., scale=)`): the routing weights, so the rows come out already
    weighted for `dispatch.unpermute_sum`.

    gmm.fuse_gate_up: gate and up run as one gmm on [w_gate | w_up] ([E, D, 2F]): xs is read
    once and, under FP8, quantized and kept for the backward once instead of twice (the layer's
    largest residual), and the backward's dxs is one gmm rather than two and their sum; the
    weight gradient is one [E, D, 2F] array (docs/performance.md). Unfused: three gmms.
    mm_in / mm_out(lhs, w) run the gmm for the input / output weights (they may all-gather
    weight slices). gate_up_slices: how many slices of the F axis mm_in gathers; the fused
    output columns then come as [slice, gate|up, F/slices] and are split accordingly.
    """
    if not gmm.fuse_gate_up:
        h_MF = swiglu(mm_in(xs_MD, w_gate), mm_in(xs_MD, w_up), gmm=gmm, scale=row_scale)
        return mm_out(h_MF, w_down)
    gu = mm_in(xs_MD, jnp.concatenate([w_gate, w_up], axis=2))
    rows = gu.shape[0]
    if gate_up_slices == 1:
        # Column slices, not a reshape to [M, 1, 2, F]: on TPU that reshape changes the tiled
        # layout, a copy of gu forward (twice under remat) and of its gradient backward.
        f = gu.shape[1] // 2
        g_MF, u_MF = gu[:, :f], gu[:, f:]
    else:
        gu = gu.reshape(rows, gate_up_slices, 2, -1)
        g_MF, u_MF = (gu[:, :, i].reshape(rows, -1) for i in (0, 1))
    return mm_out(swiglu(g_MF, u_MF, gmm=gmm, scale=row_scale), w_down)


def gmm_from_config(kernels: KernelsConfig) -> Gmm:
    """The one Gmm the model's MoE layers share, built from `kernels` (a bad backend, recipe or
    recipe option is a ConfigError naming the key, before anything compiles)."""
    try:
        return build_gmm(
            kernels.gmm_backend,
            kernels.quantization,
            kernels.recipe,
            tiling=kernels.tiling,
            checked=kernels.checked,
            grad_reduce_dtype=None
            if kernels.grad_reduce_dtype == "param"
            else kernels.grad_reduce_dtype,
            fuse_gate_up=kernels.fuse_gate_up,
            regather_weights=kernels.regather_weights,
        )
    except ValueError as e:
        raise ConfigError(f"kernels: {e}") from e
