"""FP8 numerics: block-wise and per-tensor quantization, FP8 Pallas grouped matmuls, QAG.

    q, s = quantize(x)                                   # 1 x 128 blocks along the last axis
    q, s = quantize_tensorwise(x)                        # one scale for the tensor

The recipes that run a gmm on FP8 operands around any backend are in `moetext.kernels.quant`
(fp8_blockwise, fp8_tensorwise).
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
    quantize_tensorwise,
    quantize_tiles,
)

__all__ = [
    "DualQuantized",
    "Quantized",
    "dequantize",
    "dequantize_tiles",
    "dual_quantize",
    "gmm_fp8",
    "quantize",
    "quantize_tensorwise",
    "quantize_tiles",
    "tgmm_fp8",
]
