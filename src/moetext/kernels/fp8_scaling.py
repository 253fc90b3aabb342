"""The absmax FP8 scale rule, written once for every quantizer: the XLA paths
(quant/fp8_quantize.py, quant/qag.py) and the body of the Pallas quantize kernel
(pallas/quantize_kernel.py), which is why it sits below both rooms.

scale = amax * float32(1 / max_finite(dtype)), at least the smallest normal float32, 1 for an
all-zero block; q = clip(x * (1 / scale)) rounded to `dtype`. The conventions (ragged tails,
non-finite input) are in quant/fp8_quantize.py's docstring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from moetext.kernels.typed_jax import finfo

TINY = float(np.finfo(np.float32).tiny)


def max_finite(dtype: DTypeLike) -> float:
    """The largest finite value of `dtype` (448 for float8_e4m3fn, 57344 for float8_e5m2)."""
    return float(finfo(dtype).max)


def scale_from_amax(amax: jax.Array, dtype: DTypeLike) -> jax.Array:
    """float32 scales of blocks whose float32 absmax is `amax`, for values of FP8 `dtype`."""
    # Multiplying by the float32 reciprocal (not dividing) pins the rounding: XLA rewrites
    # division by a constant into exactly this, so the oracle can match bit for bit.
    # NaN/inf amax must survive (where on `amax == 0` and maximum both keep NaN) so a
    # non-finite block dequantizes to NaN instead of to plausible garbage.
    scale = jnp.maximum(amax * np.float32(1 / max_finite(dtype)), TINY)
    return jnp.where(amax == 0, jnp.float32(1), scale).astype(jnp.float32)


def to_fp8(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
    """x / scale rounded to FP8 `dtype` (scale broadcast against x)."""
    fmax = max_finite(dtype)
    # x * (1 / scale), not x / scale: XLA turns a broadcast division into exactly this inside
    # fusions (but not op by op), so spelling it out gives the same FP8 value everywhere and
    # lets the oracle match bit for bit. Clipping matters: the product can round a hair above
    # fmax, and a value past fmax converts to NaN in e4m3fn (it has no inf).
    return jnp.clip(x.astype(jnp.float32) * (1 / scale), -fmax, fmax).astype(dtype)
