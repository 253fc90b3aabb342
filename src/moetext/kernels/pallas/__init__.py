"""Pallas TPU kernel bodies and their tilings: what the gmm backends and the quantization
recipes call. This package imports nothing of `kernels.gmm` or `kernels.quant`.

    out = gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.bfloat16)    # bf16 / f32
    out = gmm_fp8(lhs_q, lhs_scale, rhs_q, rhs_scale, group_sizes)            # FP8 + scales

Modules: `common` (the group visit schedule, block specs, the gmm / tgmm step skeletons, the
aliased output), `tiling` (per-chip tiles, block rules, VMEM limits), `gmm_kernels` (the
bf16/f32 gmm and tgmm), `fp8_gmm` / `fp8_tgmm` (FP8 operands with per-block scales),
`quantize_kernel` (1 x bs FP8 quantization along the minor axis).
"""

from moetext.kernels.pallas.fp8_gmm import gmm_fp8
from moetext.kernels.pallas.fp8_tgmm import tgmm_fp8
from moetext.kernels.pallas.gmm_kernels import gmm, tgmm
from moetext.kernels.pallas.quantize_kernel import quantize_minor
from moetext.kernels.pallas.tiling import Tiling, TilingArg

__all__ = ["Tiling", "TilingArg", "gmm", "gmm_fp8", "quantize_minor", "tgmm", "tgmm_fp8"]
