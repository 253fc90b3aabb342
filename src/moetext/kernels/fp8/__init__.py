"""FP8 block-wise quantization and FP8 grouped matmuls, composable with any gmm backend.

q, s = quantize(x)                                   # 1 x 128 blocks along the last axis
backend = QuantizedGmm(get_backend("auto"), Fp8Recipe())
out = gmm(lhs, rhs, group_sizes, backend=backend)    # FP8 forward and backward
"""

from moetext.kernels.fp8.pallas_fp8 import gmm_fp8
from moetext.kernels.fp8.pallas_tgmm_fp8 import tgmm_fp8
from moetext.kernels.fp8.quantize import (
    DualQuantized,
    Quantized,
    dequantize,
    dequantize_tiles,
    dual_quantize,
    quantize,
    quantize_tiles,
)
from moetext.kernels.fp8.quantized import QuantizedGmm
from moetext.kernels.fp8.recipe import Fp8Recipe

__all__ = [
    "DualQuantized",
    "Fp8Recipe",
    "Quantized",
    "QuantizedGmm",
    "dequantize",
    "dequantize_tiles",
    "dual_quantize",
    "gmm_fp8",
    "quantize",
    "quantize_tiles",
    "tgmm_fp8",
]
