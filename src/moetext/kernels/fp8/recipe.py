"""Fp8Recipe: how QuantizedGmm quantizes the operands of a grouped matmul and its gradients."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

_FP8 = ("float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """Block-wise FP8 recipe (DeepSeek-V3 style fine-grained scaling).

    block_size: elements per scale block along the contraction axis.
    weight_block: "1x{bs}" (a scale per bs-long run of the contraction axis, per output column;
      the backward re-quantizes weights along the other axis from the high-precision weight) or
      "{bs}x{bs}" (a scale per square tile, which serves both orientations).
    bwd_quantize: True quantizes the output gradient and runs both backward matmuls in FP8;
      False runs them at the input precision on the dequantized FP8 residuals; "auto" is True
      when the wrapped backend has a native FP8 kernel (pallas_tpu), else False.
    fwd_dtype: FP8 type of forward operands. grad_dtype: FP8 type of the quantized output
      gradient (e5m2 trades mantissa for range).
    emulation_dtype: backends without an FP8 kernel multiply the dequantized operands in this
      dtype; float32 keeps the FP8 products exact, so every backend gives the same numbers.
    save_rhs: what the forward keeps of the weights for the backward: "input" keeps the array
      as given (free when it is a parameter, which stays alive anyway), "fp8" keeps its FP8
      quantization (for weights that are temporaries, e.g. all-gathered inside shard_map).
      Activations (lhs) are always kept as FP8 values plus scales.
    qag: quantized all-gather. When gmm gets a sharded weight slice (`rhs_gather`, inside
      shard_map), each shard quantizes its slice and the all-gather moves FP8 values plus
      block amaxes instead of compute-dtype weights (kernels/fp8/qag.py); the gradient is
      reduce-scattered back. The gathered FP8 weight is what the backward keeps. False gathers
      in the compute dtype and quantizes the gathered copy.
    """

    block_size: int = 128
    weight_block: str = "1x128"
    bwd_quantize: bool | Literal["auto"] = "auto"
    fwd_dtype: str = "float8_e4m3fn"
    grad_dtype: str = "float8_e4m3fn"
    emulation_dtype: str = "float32"
    save_rhs: Literal["input", "fp8"] = "input"
    qag: bool = False

    def __post_init__(self):
        bs = self.block_size
        if not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"Fp8Recipe.block_size must be a positive int, got {bs!r}")
        valid = (f"1x{bs}", f"{bs}x{bs}")
        if self.weight_block not in valid:
            raise ValueError(
                f"Fp8Recipe.weight_block={self.weight_block!r} is not valid for block_size={bs}; "
                f"valid: {', '.join(valid)}"
            )
        if self.bwd_quantize not in (True, False, "auto"):
            raise ValueError(
                f"Fp8Recipe.bwd_quantize must be True, False or 'auto', got {self.bwd_quantize!r}"
            )
        for field in ("fwd_dtype", "grad_dtype"):
            name = jnp.dtype(getattr(self, field)).name
            if name not in _FP8:
                raise ValueError(f"Fp8Recipe.{field} must be one of {_FP8}, got {name!r}")
            object.__setattr__(self, field, name)
        emu = jnp.dtype(self.emulation_dtype).name
        if emu not in ("float32", "bfloat16"):
            raise ValueError(f"Fp8Recipe.emulation_dtype must be float32 or bfloat16, got {emu!r}")
        object.__setattr__(self, "emulation_dtype", emu)
        if not isinstance(self.qag, bool):
            raise ValueError(f"Fp8Recipe.qag must be a bool, got {self.qag!r}")
        if self.save_rhs not in ("input", "fp8"):
            raise ValueError(f"Fp8Recipe.save_rhs must be 'input' or 'fp8', got {self.save_rhs!r}")

    @property
    def tiled_weights(self) -> bool:
        return self.weight_block != f"1x{self.block_size}"
