"""QuantizedGmm: wraps any gmm backend so gmm/tgmm (and their gradients) run on FP8 operands.

Legend: M rows (sorted by group), K contraction, N outputs, L local groups, bs block size.

    backend = QuantizedGmm(get_backend("blocked"), Fp8Recipe())
    out = moetext.kernels.gmm.gmm(lhs, rhs, group_sizes, backend=backend)

How the FP8 operands get multiplied depends on the wrapped backend: one with a native FP8
kernel (`_NATIVE`, today pallas_tpu -> gmm_fp8/tgmm_fp8) runs it; any other multiplies the
dequantized operands with its own gmm/tgmm in recipe.emulation_dtype, which gives the same
FP8-rounded numbers. No backend knows about FP8.

Autodiff: api.gmm/tgmm call `differentiable_gmm/tgmm` when a backend defines them, so this
wrapper owns its custom_vjp: the forward keeps lhs as FP8 values + scales (in the orientation the
backward needs), never a high-precision copy, and the backward quantizes the output gradient
when the recipe says so.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moetext.kernels.fp8 import pallas_fp8, pallas_tgmm_fp8
from moetext.kernels.fp8.qag import quantized_all_gather
from moetext.kernels.fp8.quantize import DualQuantized, Quantized
from moetext.kernels.fp8.recipe import Fp8Recipe
from moetext.kernels.gmm.backend import GmmBackend
from moetext.kernels.gmm.gather import gather_weight, reduce_scatter_grad


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _per_column_scale(rq: Quantized, contract_axis: int):
    """rhs scales in gmm_fp8's layout: blocks along the contraction axis, one per column."""
    if rq.axis is not None:
        return rq.scale
    other = 3 - contract_axis  # tiles: repeat the tile scale over the non-contraction axis
    s = jnp.repeat(rq.scale, rq.block_size, axis=other)
    return jax.lax.slice_in_dim(s, 0, rq.value.shape[other], axis=other)


def _native_pallas_gmm(backend, lq, rq, group_sizes, *, transpose_rhs, group_offset, tiling, pet):
    contract = 2 if transpose_rhs else 1
    bs = lq.block_size
    k_pad = lq.scale.shape[1] * bs  # gmm_fp8 wants whole blocks: pad K with FP8 zeros
    return pallas_fp8.gmm_fp8(
        _pad_axis(lq.value, 1, k_pad),
        lq.scale,
        _pad_axis(rq.value, contract, k_pad),
        _per_column_scale(rq, contract),
        group_sizes,
        group_offset=group_offset,
        transpose_rhs=transpose_rhs,
        block_size=bs,
        tiling=tiling,
        preferred_element_type=pet,
        interpret=getattr(backend, "interpret", None),
        chip=getattr(backend, "chip", None),
    )


def _native_pallas_tgmm(backend, lq, rq, group_sizes, *, num_groups, group_offset, tiling, pet):
    return pallas_tgmm_fp8.tgmm_fp8(
        lq.value,
        lq.scale,
        rq.value,
        rq.scale,
        group_sizes,
        num_groups=num_groups,
        group_offset=group_offset,
        block_size=lq.block_size,
        tiling=tiling,
        preferred_element_type=pet,
        interpret=getattr(backend, "interpret", None),
        chip=getattr(backend, "chip", None),
    )


# Backends (by name) that have fused FP8 kernels; every other backend is emulated. Adding one is
# adding an entry here, not a flag anywhere else.
_NATIVE = {"pallas_tpu": (_native_pallas_gmm, _native_pallas_tgmm)}


@dataclasses.dataclass(frozen=True)
class QuantizedGmm:
    """A GmmBackend running `backend`'s grouped matmuls on block-wise FP8 operands."""

    backend: GmmBackend
    recipe: Fp8Recipe = Fp8Recipe()

    def __post_init__(self):
        if isinstance(self.backend, QuantizedGmm):
            raise ValueError(f"QuantizedGmm: backend {self.backend.name} is already quantized")
        if not isinstance(self.backend, GmmBackend):
            raise ValueError(
                f"QuantizedGmm: backend must implement GmmBackend (gmm, tgmm, name), got "
                f"{type(self.backend).__name__}"
            )
        if not isinstance(self.recipe, Fp8Recipe):
            raise ValueError(f"QuantizedGmm: recipe must be an Fp8Recipe, got {self.recipe!r}")

    @property
    def name(self) -> str:
        return f"fp8[{self.backend.name}]"

    @property
    def native(self) -> bool:
        return self.backend.name in _NATIVE

    @property
    def bwd_quantize(self) -> bool:
        q = self.recipe.bwd_quantize
        return self.native if q == "auto" else bool(q)

    # --- quantization of each operand ----------------------------------------------------------

    def _q(self, x, axis, dtype=None) -> Quantized:
        r = self.recipe
        # Native backends quantize with the Pallas kernel too (same interpret setting): XLA's
        # TPU lowering of the last-axis block amax needs a full float32 copy of x.
        impl = "pallas" if self.native else "xla"
        return Quantized.of(
            x,
            axis=axis,
            block_size=r.block_size,
            dtype=dtype or r.fwd_dtype,
            impl=impl,
            interpret=getattr(self.backend, "interpret", None),
        )

    def quantize_residual(self, x) -> Quantized:
        """How this recipe keeps an activation for the backward outside a gmm (the SwiGLU
        inputs, kernels/activations.py): FP8 values + scales in blocks along the last axis."""
        return self._q(x, x.ndim - 1)

    def _q_rhs(self, rhs, contract_axis: int) -> Quantized:
        """Weights [L, *, *] blocked along `contract_axis`, or in square tiles."""
        return self._q(rhs, None if self.recipe.tiled_weights else contract_axis)

    # --- FP8 matmuls on quantized operands -----------------------------------------------------

    def _mm(
        self, lq: Quantized, rq: Quantized, group_sizes, *, transpose_rhs, group_offset, tiling, pet
    ):
        if self.native:
            return _NATIVE[self.backend.name][0](
                self.backend,
                lq,
                rq,
                group_sizes,
                transpose_rhs=transpose_rhs,
                group_offset=group_offset,
                tiling=tiling,
                pet=pet,
            )
        emu = self.recipe.emulation_dtype
        return self.backend.gmm(
            lq.dequantize(emu),
            rq.dequantize(emu),
            group_sizes,
            preferred_element_type=pet,
            transpose_rhs=transpose_rhs,
            group_offset=group_offset,
            tiling=tiling,
        )

    def _tmm(
        self, lq: Quantized, rq: Quantized, group_sizes, *, num_groups, group_offset, tiling, pet
    ):
        if self.native:
            return _NATIVE[self.backend.name][1](
                self.backend,
                lq,
                rq,
                group_sizes,
                num_groups=num_groups,
                group_offset=group_offset,
                tiling=tiling,
                pet=pet,
            )
        emu = self.recipe.emulation_dtype
        return self.backend.tgmm(
            lq.dequantize(emu),
            rq.dequantize(emu),
            group_sizes,
            num_groups=num_groups,
            preferred_element_type=pet,
            group_offset=group_offset,
            tiling=tiling,
        )

    # --- GmmBackend protocol (forward only) ----------------------------------------------------

    def gmm(
        self, lhs, rhs, group_sizes, *, preferred_element_type, transpose_rhs, group_offset, tiling
    ):
        return self._mm(
            self._q(lhs, 1),
            self._q_rhs(rhs, 2 if transpose_rhs else 1),
            group_sizes,
            transpose_rhs=transpose_rhs,
            group_offset=group_offset,
            tiling=tiling,
            pet=jnp.dtype(preferred_element_type),
        )

    def tgmm(
        self, lhs, rhs, group_sizes, *, num_groups, preferred_element_type, group_offset, tiling
    ):
        return self._tmm(
            self._q(lhs, 0),
            self._q(rhs, 0),
            group_sizes,
            num_groups=num_groups,
            group_offset=group_offset,
            tiling=tiling,
            pet=jnp.dtype(preferred_element_type),
        )

    # --- autodiff seam honoured by moetext.kernels.gmm.api -------------------------------------

    def differentiable_gmm(
        self, lhs, rhs, group_sizes, *, preferred_element_type, transpose_rhs, group_offset, tiling
    ):
        static = self._static(preferred_element_type, bool(transpose_rhs), tiling, lhs, rhs)
        return _qgmm(static, lhs, rhs, group_sizes, group_offset)

    def differentiable_gathered_gmm(
        self,
        lhs,
        rhs,
        group_sizes,
        *,
        gather,
        preferred_element_type,
        transpose_rhs,
        group_offset,
        tiling,
        grad_reduce_dtype=None,
    ):
        """gmm on a weight slice split along `gather` (api.gmm's rhs_gather): QAG when the
        recipe asks (FP8 on the wire), else the plain compute-dtype all-gather."""
        kw = dict(
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
            group_offset=group_offset,
            tiling=tiling,
        )
        if not self.recipe.qag:
            full = gather_weight(rhs, gather, lhs.dtype, grad_reduce_dtype)
            return self.differentiable_gmm(lhs, full, group_sizes, **kw)
        static = self._static(preferred_element_type, bool(transpose_rhs), tiling, lhs, rhs)
        rd = None if grad_reduce_dtype is None else jnp.dtype(grad_reduce_dtype)
        return _qag_gmm((*static, gather, rd), lhs, rhs, group_sizes, group_offset)

    def differentiable_tgmm(
        self, lhs, rhs, group_sizes, *, num_groups, preferred_element_type, group_offset, tiling
    ):
        static = self._static(preferred_element_type, int(num_groups), tiling, lhs, rhs)
        return _qtgmm(static, lhs, rhs, group_sizes, group_offset)

    def _static(self, pet, mode, tiling, lhs, rhs) -> tuple:
        """The custom_vjps' static argument: (self, pet, transpose_rhs or num_groups, tiling,
        lhs dtype, rhs dtype)."""
        return (self, jnp.dtype(pet), mode, tiling, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))


# --- gmm: out = lhs @ rhs[g] -------------------------------------------------------------------


def _forward(qb, lhs, rq, group_sizes, group_offset, transpose_rhs, tiling, pet):
    """out = lhs @ rq[g] on FP8 operands, and lhs as the backward keeps it."""
    lrow = qb._q(lhs, 1)
    out = qb._mm(
        lrow,
        rq,
        group_sizes,
        transpose_rhs=transpose_rhs,
        group_offset=group_offset,
        tiling=tiling,
        pet=pet,
    )
    # drhs = tgmm(lhs, dout) reduces over M, so a quantized backward wants lhs blocked along M;
    # a high-precision one only dequantizes it and reuses the forward's quantization.
    return out, (qb._q(lhs, 0) if qb.bwd_quantize else lrow)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qgmm(static, lhs, rhs, group_sizes, group_offset):
    return _qgmm_fwd(static, lhs, rhs, group_sizes, group_offset)[0]


def _qgmm_fwd(static, lhs, rhs, group_sizes, group_offset):
    qb, pet, transpose_rhs, tiling, _, _ = static
    contract = 2 if transpose_rhs else 1
    rq = qb._q_rhs(rhs, contract)
    out, lhs_res = _forward(qb, lhs, rq, group_sizes, group_offset, transpose_rhs, tiling, pet)
    if qb.recipe.save_rhs == "input":
        rhs_res = rhs
    elif qb.recipe.tiled_weights or not qb.bwd_quantize:
        rhs_res = rq
    else:  # the backward contracts N: the other orientation, from the high-precision weights
        rhs_res = qb._q_rhs(rhs, 3 - contract)
    return out, (lhs_res, rhs_res, group_sizes, group_offset)


def _qgmm_bwd(static, res, dout):
    qb, _, transpose_rhs, tiling, lhs_dtype, rhs_dtype = static
    lhs_res, rhs_res, group_sizes, group_offset = res
    # Tie the weights to dout so their backward quantization stays in the backward: else XLA
    # fuses it with the forward one (same operand) and keeps it alive across the forward pass.
    rhs_res, dout = jax.lax.optimization_barrier((rhs_res, dout))
    num_local = rhs_res.value.shape[0] if isinstance(rhs_res, Quantized) else rhs_res.shape[0]
    common = dict(group_offset=group_offset, tiling=tiling)
    if qb.bwd_quantize:
        gd = qb.recipe.grad_dtype
        d = DualQuantized(qb._q(dout, 1, gd), qb._q(dout, 0, gd))
        rq = (
            rhs_res
            if isinstance(rhs_res, Quantized)
            else qb._q_rhs(rhs_res, 1 if transpose_rhs else 2)
        )
        dlhs = qb._mm(
            d.rowwise, rq, group_sizes, transpose_rhs=not transpose_rhs, pet=lhs_dtype, **common
        )
        a, b = (d.colwise, lhs_res) if transpose_rhs else (lhs_res, d.colwise)
        drhs = qb._tmm(a, b, group_sizes, num_groups=num_local, pet=rhs_dtype, **common)
    else:
        be = qb.backend
        lhs = lhs_res.dequantize(lhs_dtype)
        rhs = rhs_res.dequantize(rhs_dtype) if isinstance(rhs_res, Quantized) else rhs_res
        dout = dout.astype(lhs_dtype)
        dlhs = be.gmm(
            dout,
            rhs,
            group_sizes,
            preferred_element_type=lhs_dtype,
            transpose_rhs=not transpose_rhs,
            **common,
        )
        a, b = (dout, lhs) if transpose_rhs else (lhs, dout)
        drhs = be.tgmm(
            a, b, group_sizes, num_groups=num_local, preferred_element_type=rhs_dtype, **common
        )
    return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype), None, None


_qgmm.defvjp(_qgmm_fwd, _qgmm_bwd)


# --- QAG: out = lhs @ all_gather(rhs slice)[g], the slice all-gathered as FP8 ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qag_gmm(static, lhs, rhs, group_sizes, group_offset):
    return _qag_gmm_fwd(static, lhs, rhs, group_sizes, group_offset)[0]


def _qag_gmm_fwd(static, lhs, rhs, group_sizes, group_offset):
    qb, pet, transpose_rhs, tiling, lhs_dtype, _, gather, _ = static
    r = qb.recipe
    contract = 2 if transpose_rhs else 1
    # The slice in the compute dtype, as the plain path gathers it: same FP8 numbers.
    rq = quantized_all_gather(
        rhs.astype(lhs_dtype),
        gather,
        axis=None if r.tiled_weights else contract,
        block_size=r.block_size,
        dtype=r.fwd_dtype,
    )
    out, lhs_res = _forward(qb, lhs, rq, group_sizes, group_offset, transpose_rhs, tiling, pet)
    rhs_res = rq
    if qb.bwd_quantize and not r.tiled_weights:
        # The FP8 backward contracts N and wants blocks along it; the high-precision gathered
        # weight never exists under QAG, so re-block the dequantized FP8 one (a second rounding,
        # docs/kernels.md). Tiled weights (bs x bs) serve both orientations and avoid it.
        rhs_res = qb._q_rhs(rq.dequantize(lhs_dtype), 3 - contract)
    return out, (lhs_res, rhs_res, group_sizes, group_offset)


def _qag_gmm_bwd(static, res, dout):
    qb, pet, transpose_rhs, tiling, lhs_dtype, rhs_dtype, gather, reduce_dtype = static
    # QuantizedGmm's backward on the gathered weight (in the compute dtype, as the plain path's
    # gradient), then each shard keeps the sum over shards of its own slice.
    dlhs, drhs, _, _ = _qgmm_bwd((qb, pet, transpose_rhs, tiling, lhs_dtype, lhs_dtype), res, dout)
    return dlhs, reduce_scatter_grad(drhs, gather, reduce_dtype, rhs_dtype), None, None


_qag_gmm.defvjp(_qag_gmm_fwd, _qag_gmm_bwd)


# --- tgmm: out[g] = lhs[rows of g].T @ rhs[rows of g] ------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qtgmm(static, lhs, rhs, group_sizes, group_offset):
    return _qtgmm_fwd(static, lhs, rhs, group_sizes, group_offset)[0]


def _qtgmm_fwd(static, lhs, rhs, group_sizes, group_offset):
    qb, pet, num_groups, tiling, _, _ = static
    lq, rq = qb._q(lhs, 0), qb._q(rhs, 0)
    out = qb._tmm(
        lq,
        rq,
        group_sizes,
        num_groups=num_groups,
        group_offset=group_offset,
        tiling=tiling,
        pet=pet,
    )
    return out, (lq, rq, group_sizes, group_offset)


def _qtgmm_bwd(static, res, dout):
    # tgmm is itself the weight gradient of gmm; its own gradient (second order) runs at the
    # input precision on the dequantized FP8 residuals.
    qb, _, _, tiling, lhs_dtype, rhs_dtype = static
    lq, rq, group_sizes, group_offset = res
    lhs, rhs = lq.dequantize(lhs_dtype), rq.dequantize(rhs_dtype)
    common = dict(group_offset=group_offset, tiling=tiling)
    dlhs = qb.backend.gmm(
        rhs,
        dout.astype(rhs_dtype),
        group_sizes,
        preferred_element_type=lhs_dtype,
        transpose_rhs=True,
        **common,
    )
    drhs = qb.backend.gmm(
        lhs,
        dout.astype(lhs_dtype),
        group_sizes,
        preferred_element_type=rhs_dtype,
        transpose_rhs=False,
        **common,
    )
    return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype), None, None


_qtgmm.defvjp(_qtgmm_fwd, _qtgmm_bwd)
