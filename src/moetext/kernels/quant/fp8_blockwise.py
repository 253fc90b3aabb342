"""Recipe "fp8_blockwise": block-wise FP8 gmm/tgmm and gradients around any backend (+ QAG).

Legend: M rows (sorted by group), K contraction, N outputs, L local groups, bs block size.

    op = Gmm(get_backend("blocked"), Fp8Blockwise())
    out = op(lhs, rhs, group_sizes)                     # FP8 forward, FP8 residuals

Operands are quantized per 1 x bs block (DeepSeek-V3 style fine-grained scaling). How the FP8
operands get multiplied depends on the backend: one with fused kernels registered in
quant/scaled_kernels.py (pallas_tpu: gmm_fp8 / tgmm_fp8) runs them; any other multiplies the
dequantized operands with its own gmm / tgmm in `emulation_dtype` (`DequantizedKernels`, same
file), which gives the same FP8-rounded numbers. No backend knows about FP8.

Autodiff: the forward keeps lhs as FP8 values + scales (in the orientation the backward needs),
never a high-precision copy; the backward quantizes the output gradient when `bwd_quantize`
says so. Under `qag` a sharded weight slice crosses the wire as FP8 (kernels/quant/qag.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall
from moetext.kernels.gmm.gather import WeightGather, narrow, reduce_scatter_tiled
from moetext.kernels.gmm.recipe import Recipe, dlhs_call, static_vjp, tgmm_backward, tgmm_call
from moetext.kernels.quant.fp8_quantize import DualQuantized, Quantized
from moetext.kernels.quant.qag import quantized_all_gather
from moetext.kernels.quant.scaled_kernels import (
    DequantizedKernels,
    ScaledKernels,
    scaled_kernels_for,
)
from moetext.kernels.typed_jax import optimization_barrier

_FP8 = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Fp8Blockwise(Recipe):
    """Block-wise FP8 (fields are the recipe's options, `kernels.recipe.<field>` in a config).

    block_size: elements per scale block along the contraction axis.
    weight_block: "1x{bs}" (a scale per bs-long run of the contraction axis, per output column;
      the backward re-quantizes weights along the other axis from the high-precision weight),
      "{bs}x{bs}" (a scale per square tile, which serves both orientations) or "auto":
      "{bs}x{bs}" under `qag`, else "1x{bs}". Under QAG the high-precision gathered weight never
      exists, so 1x{bs} blocks re-block a dequantized copy of the gathered FP8 weight along N
      for the backward: a transient bf16 copy of every gathered weight, which put the
      Qwen3-30B-A3B FP8 + QAG step above bf16 (docs/performance.md); square tiles avoid it.
    bwd_quantize: True quantizes the output gradient and runs both backward matmuls in FP8;
      False runs them at the input precision on the dequantized FP8 residuals; "auto" is True
      when the backend has fused scaled kernels (pallas_tpu), else False.
    fwd_dtype: FP8 type of forward operands. grad_dtype: FP8 type of the quantized output
      gradient (e5m2 trades mantissa for range).
    emulation_dtype: backends without fused kernels multiply the dequantized operands in this
      dtype; float32 keeps the FP8 products exact, so every backend gives the same numbers.
    save_rhs: what the forward keeps of the weights for the backward: "input" keeps the array
      as given (free when it is a parameter, which stays alive anyway), "fp8" keeps its FP8
      quantization (for weights that are temporaries, e.g. all-gathered inside shard_map).
      Activations (lhs) are always kept as FP8 values plus scales.
    qag: quantized all-gather. When gmm gets a sharded weight slice (`rhs_gather`, inside
      shard_map), each shard quantizes its slice and the all-gather moves FP8 values plus
      block amaxes instead of compute-dtype weights (kernels/quant/qag.py); the gradient is
      computed and reduce-scattered back a column tile at a time (gather.reduce_scatter_tiled,
      as the bf16 path), so no layer holds a whole gathered weight gradient. The gathered FP8
      weight is what the backward keeps. False gathers in the compute dtype and quantizes the
      gathered copy.
    """

    name: ClassVar[str] = "fp8_blockwise"

    block_size: int = 128
    weight_block: str = "auto"
    bwd_quantize: bool | Literal["auto"] = "auto"
    fwd_dtype: str = "float8_e4m3fn"
    grad_dtype: str = "float8_e4m3fn"
    emulation_dtype: str = "float32"
    save_rhs: Literal["input", "fp8"] = "input"
    qag: bool = False

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            raise ValueError(f"fp8_blockwise: block_size must be a positive int, got {bs!r}")
        if not isinstance(self.qag, bool):
            raise ValueError(f"fp8_blockwise: qag must be a bool, got {self.qag!r}")
        valid = (f"1x{bs}", f"{bs}x{bs}", "auto")
        if self.weight_block == "auto":
            object.__setattr__(self, "weight_block", f"{bs}x{bs}" if self.qag else f"1x{bs}")
        if self.weight_block not in valid:
            raise ValueError(
                f"fp8_blockwise: weight_block={self.weight_block!r} is not valid for "
                f"block_size={bs}; valid: {', '.join(valid)}"
            )
        if self.bwd_quantize not in (True, False, "auto"):
            raise ValueError(
                f"fp8_blockwise: bwd_quantize must be True, False or 'auto', got "
                f"{self.bwd_quantize!r}"
            )
        for field in ("fwd_dtype", "grad_dtype"):
            name = jnp.dtype(getattr(self, field)).name
            if name not in _FP8:
                raise ValueError(f"fp8_blockwise: {field} must be one of {_FP8}, got {name!r}")
            object.__setattr__(self, field, name)
        emu = jnp.dtype(self.emulation_dtype).name
        if emu not in ("float32", "bfloat16"):
            raise ValueError(
                f"fp8_blockwise: emulation_dtype must be float32 or bfloat16, got {emu!r}"
            )
        object.__setattr__(self, "emulation_dtype", emu)
        if self.save_rhs not in ("input", "fp8"):
            raise ValueError(
                f"fp8_blockwise: save_rhs must be 'input' or 'fp8', got {self.save_rhs!r}"
            )

    @property
    def tiled_weights(self) -> bool:
        return self.weight_block != f"1x{self.block_size}"

    def bind(self, backend: GmmBackend) -> Fp8Ops:
        """This recipe on `backend`: its fused scaled kernels, or the dequantizing emulation."""
        native = scaled_kernels_for(backend)
        kernels = (
            native if native is not None else DequantizedKernels(backend, self.emulation_dtype)
        )
        bwd = (native is not None) if self.bwd_quantize == "auto" else bool(self.bwd_quantize)
        return Fp8Ops(self, backend, kernels, bwd)

    # --- Recipe ----------------------------------------------------------------------------------

    def gmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _qgmm(self._static(backend, lhs, rhs), lhs, rhs, sizes, call)

    def tgmm(
        self, backend: GmmBackend, lhs: Array, rhs: Array, sizes: Array, call: GmmCall
    ) -> Array:
        return _qtgmm(self._static(backend, lhs, rhs), lhs, rhs, sizes, call)

    def gathered_gmm(
        self,
        backend: GmmBackend,
        lhs: Array,
        rhs: Array,
        group_sizes: Array,
        call: GmmCall,
        gather: WeightGather,
    ) -> Array:
        """QAG when the recipe asks (FP8 on the wire), else the compute-dtype all-gather.
        gather.regather (gathering again in the backward) is not implemented: the default
        raises a ValueError naming this recipe."""
        if gather.regather or not self.qag:
            return super().gathered_gmm(backend, lhs, rhs, group_sizes, call, gather)
        static = _QagStatic(self._static(backend, lhs, rhs), gather)
        return _qag_gmm(static, lhs, rhs, group_sizes, call)

    def store_residual(self, backend: GmmBackend, x: jax.Array) -> Quantized:
        """FP8 values + scales in blocks along the last axis, like the gmm's own activations."""
        return self.bind(backend).quantize(x, x.ndim - 1)

    def load_residual(self, stored: Any, dtype: DTypeLike) -> jax.Array:
        q: Quantized = stored
        return q.dequantize(dtype)

    def _static(self, backend: GmmBackend, lhs: jax.Array, rhs: jax.Array) -> _Static:
        return _Static(self.bind(backend), jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))


@dataclasses.dataclass(frozen=True)
class Fp8Ops:
    """The recipe bound to a backend (`Fp8Blockwise.bind`): how each operand is quantized and
    what multiplies it. Hashable: the custom_vjps' static argument."""

    recipe: Fp8Blockwise
    backend: GmmBackend  # for the high-precision backward (bwd_quantize False)
    kernels: ScaledKernels
    bwd_quantize: bool  # "auto" resolved

    def quantize(self, x: jax.Array, axis: int | None, dtype: str | None = None) -> Quantized:
        r = self.recipe
        return self.kernels.quantize(
            x, axis=axis, block_size=r.block_size, dtype=dtype or r.fwd_dtype
        )

    def quantize_rhs(self, rhs: jax.Array, contract_axis: int) -> Quantized:
        """Weights [L, *, *] blocked along `contract_axis`, or in square tiles."""
        return self.quantize(rhs, None if self.recipe.tiled_weights else contract_axis)


class _Static(NamedTuple):
    """The custom_vjps' static argument; the per-call options travel in their GmmCall."""

    ops: Fp8Ops
    lhs_dtype: jnp.dtype
    rhs_dtype: jnp.dtype


class _QagStatic(NamedTuple):
    gmm: _Static
    gather: WeightGather


_Res = tuple[Quantized, Any, jax.Array, GmmCall]  # lhs, rhs (array or Quantized), sizes, call


# --- gmm: out = lhs @ rhs[g] -------------------------------------------------------------------


def _forward(
    s: _Static, lhs: jax.Array, rq: Quantized, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, Quantized]:
    """out = lhs @ rq[g] on FP8 operands, and lhs as the backward keeps it."""
    lrow = s.ops.quantize(lhs, 1)
    out = s.ops.kernels.gmm(lrow, rq, group_sizes, call)
    # drhs = tgmm(lhs, dout) reduces over M, so a quantized backward wants lhs blocked along M;
    # a high-precision one only dequantizes it and reuses the forward's quantization.
    return out, (s.ops.quantize(lhs, 0) if s.ops.bwd_quantize else lrow)


def _qgmm_fwd(
    s: _Static, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, _Res]:
    contract = 2 if call.transpose_rhs else 1
    rq = s.ops.quantize_rhs(rhs, contract)
    out, lhs_res = _forward(s, lhs, rq, group_sizes, call)
    rhs_res: jax.Array | Quantized
    if s.ops.recipe.save_rhs == "input":
        rhs_res = rhs
    elif s.ops.recipe.tiled_weights or not s.ops.bwd_quantize:
        rhs_res = rq
    else:  # the backward contracts N: the other orientation, from the high-precision weights
        rhs_res = s.ops.quantize_rhs(rhs, 3 - contract)
    return out, (lhs_res, rhs_res, group_sizes, call)


def _qgmm_bwd(s: _Static, res: _Res, dout: jax.Array) -> tuple[Any, ...]:
    dlhs, drhs_of, a, b = _bwd_parts(s, res, dout)
    return dlhs, drhs_of(a, b), None, None


def _bwd_parts(
    s: _Static, res: _Res, dout: jax.Array
) -> tuple[jax.Array, Callable[[Any, Any], jax.Array], Any, Any]:
    """(dlhs, drhs_of, a, b): the lhs gradient, and the weight gradient as drhs_of(a, b) on
    operands [M, K'] and [M, N'] (columns of a, b give those columns of drhs: QAG's backward
    computes it a column tile at a time). Quantized operands are blocked along M."""
    lhs_res, rhs_res, group_sizes, call = res
    ops, pet_l, pet_r = s.ops, s.lhs_dtype, s.rhs_dtype
    # Tie the weights to dout so their backward quantization stays in the backward: else XLA
    # fuses it with the forward one (same operand) and keeps it alive across the forward pass.
    rhs_res, dout = optimization_barrier((rhs_res, dout))
    num_local = rhs_res.value.shape[0] if isinstance(rhs_res, Quantized) else rhs_res.shape[0]
    a: Any  # the weight gradient's operands: Quantized (blocked along M) or arrays
    b: Any
    tgmm: Callable[..., jax.Array]
    if ops.bwd_quantize:
        gd = ops.recipe.grad_dtype
        d = DualQuantized(ops.quantize(dout, 1, gd), ops.quantize(dout, 0, gd))
        rq = (
            rhs_res
            if isinstance(rhs_res, Quantized)
            else ops.quantize_rhs(rhs_res, 1 if call.transpose_rhs else 2)
        )
        dlhs = ops.kernels.gmm(d.rowwise, rq, group_sizes, dlhs_call(call, pet_l))
        a, b = (d.colwise, lhs_res) if call.transpose_rhs else (lhs_res, d.colwise)
        tgmm = ops.kernels.tgmm
    else:
        be = ops.backend
        lhs = lhs_res.dequantize(pet_l)
        rhs = rhs_res.dequantize(pet_r) if isinstance(rhs_res, Quantized) else rhs_res
        dout = dout.astype(pet_l)
        dlhs = be.gmm(dout, rhs, group_sizes, dlhs_call(call, pet_l))
        a, b = (dout, lhs) if call.transpose_rhs else (lhs, dout)
        tgmm = be.tgmm
    drhs_call = tgmm_call(call, num_local, pet_r)

    def drhs_of(a: Any, b: Any) -> jax.Array:
        return tgmm(a, b, group_sizes, drhs_call).astype(pet_r)

    return dlhs.astype(pet_l), drhs_of, a, b


_qgmm = static_vjp(_qgmm_fwd, _qgmm_bwd)


# --- QAG: out = lhs @ all_gather(rhs slice)[g], the slice all-gathered as FP8 ------------------


def _qag_gmm_fwd(
    s: _QagStatic, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, _Res]:
    g, r = s.gmm, s.gmm.ops.recipe
    contract = 2 if call.transpose_rhs else 1
    # The slice in the compute dtype, as the plain path gathers it: same FP8 numbers.
    rq = quantized_all_gather(
        narrow(rhs, g.lhs_dtype),  # cast per layer, not hoisted out of the scan (gather.py)
        s.gather.dims,
        axis=None if r.tiled_weights else contract,
        block_size=r.block_size,
        dtype=r.fwd_dtype,
        jointly=s.gather.jointly,
    )
    out, lhs_res = _forward(g, lhs, rq, group_sizes, call)
    rhs_res = rq
    if g.ops.bwd_quantize and not r.tiled_weights:
        # The FP8 backward contracts N and wants blocks along it; the high-precision gathered
        # weight never exists under QAG, so re-block the dequantized FP8 one (a second rounding,
        # docs/kernels.md). Tiled weights (bs x bs) serve both orientations and avoid it.
        rhs_res = g.ops.quantize_rhs(rq.dequantize(g.lhs_dtype), 3 - contract)
    return out, (lhs_res, rhs_res, group_sizes, call)


def _qag_gmm_bwd(s: _QagStatic, res: _Res, dout: jax.Array) -> tuple[Any, ...]:
    # The gmm backward on the gathered weight (in the compute dtype, as the plain path's
    # gradient); each shard keeps the sum over shards of its own slice, computed and
    # reduce-scattered a column tile at a time like recipe.NoQuantization's, so no layer holds
    # the whole gathered weight gradient (0.75 / 1.5 GiB f32 per Qwen3-30B-A3B layer).
    on_gathered = s.gmm._replace(rhs_dtype=s.gmm.lhs_dtype)
    dlhs, drhs_of, a, b = _bwd_parts(on_gathered, res, dout)
    # A column tile of an FP8 operand keeps its scales only when they are per block of rows.
    assert all(x.axis == 0 for x in (a, b) if isinstance(x, Quantized))
    kept = res[1]  # the gathered weight as kept (FP8): drhs has its shape
    g, k, n = kept.value.shape if isinstance(kept, Quantized) else kept.shape
    gather = s.gather
    dw = reduce_scatter_tiled(
        drhs_of, a, b, (g, k, n), gather.dims, gather.reduce_dtype, s.gmm.rhs_dtype
    )
    return dlhs, dw, None, None


_qag_gmm = static_vjp(_qag_gmm_fwd, _qag_gmm_bwd)


# --- tgmm: out[g] = lhs[rows of g].T @ rhs[rows of g] ------------------------------------------


_TRes = tuple[Quantized, Quantized, jax.Array, GmmCall]


def _qtgmm_fwd(
    s: _Static, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, call: GmmCall
) -> tuple[jax.Array, _TRes]:
    lq, rq = s.ops.quantize(lhs, 0), s.ops.quantize(rhs, 0)
    out = s.ops.kernels.tgmm(lq, rq, group_sizes, call)
    return out, (lq, rq, group_sizes, call)


def _qtgmm_bwd(s: _Static, res: _TRes, dout: jax.Array) -> tuple[Any, ...]:
    # tgmm is itself the weight gradient of gmm; its own gradient (second order) runs at the
    # input precision on the dequantized FP8 residuals.
    lq, rq, group_sizes, call = res
    lhs, rhs = lq.dequantize(s.lhs_dtype), rq.dequantize(s.rhs_dtype)
    grads = tgmm_backward(s.ops.backend, lhs, rhs, group_sizes, call, dout, cast_dout=True)
    return (*grads, None, None)


_qtgmm = static_vjp(_qtgmm_fwd, _qtgmm_bwd)
