"""DeepSeek's RoPE: YaRN-scaled frequencies, the YaRN softmax-scale fold, interleaved pairs.

Legend: B batch, S sequence, N heads, R qk_rope_head_dim (the rotated part of a head),
h = R // 2 frequencies.

Follows transformers 5 (`modeling_rope_utils._compute_yarn_parameters` and
`models/deepseek_v3/modeling_deepseek_v3.py`), which is what released checkpoints are served
with:

- inverse frequencies blend interpolation (1 / (factor * theta^(2i/R))) and extrapolation
  (1 / theta^(2i/R)) with a linear ramp between the correction dims of beta_fast and beta_slow
  rotations over `original_max_position_embeddings` (floored/ceiled when `truncate`);
- cos and sin are multiplied by attention_factor = mscale(factor, mscale) /
  mscale(factor, mscale_all_dim) when both are set, else mscale(factor, 1), where
  mscale(s, m) = 0.1 m ln(s) + 1 for s > 1 and 1 otherwise (1.0 for DeepSeek-V3's published
  mscale = mscale_all_dim = 1);
- the attention's softmax scale is (qk_head_dim)^-0.5 * mscale(factor, mscale_all_dim)^2 when
  mscale_all_dim is set (`DeepseekV3Attention.scaling`);
- with `rope_interleave` each rotated vector [x0, x1, x2, x3, ...] is first reordered to
  [x0, x2, ..., x1, x3, ...] (`apply_rotary_pos_emb_interleave`), then rotated by halves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moetext.models.layers.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN context extension, HF `rope_scaling` / `rope_parameters` with rope_type "yarn"."""

    factor: float
    """Context extension factor (DeepSeek-V3: 40)."""
    original_max_position_embeddings: int
    """The context length the frequencies were trained at (DeepSeek-V3: 4096)."""
    beta_fast: float = 32.0
    """Dims turning more often than this over the original context keep their frequency."""
    beta_slow: float = 1.0
    """Dims turning less often than this are divided by factor; a linear ramp in between."""
    mscale: float | None = None
    """YaRN mscale of cos/sin; None or 0 = unset (HF)."""
    mscale_all_dim: float | None = None
    """mscale folded into the softmax scale (squared); None or 0 = unset (HF)."""
    attention_factor: float | None = None
    """Explicit cos/sin factor, overriding the mscale rule (HF `attention_factor`)."""
    truncate: bool = True
    """Floor/ceil the correction range to whole dims (HF default)."""

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"yarn factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "yarn original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(
                f"yarn beta_fast and beta_slow must be > 0, got {self.beta_fast}, {self.beta_slow}"
            )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1 (transformers' `yarn_get_mscale`)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(yarn: Yarn) -> float:
    """The factor transformers multiplies cos and sin by (`_compute_yarn_parameters`)."""
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(
            yarn.factor, yarn.mscale_all_dim
        )
    return yarn_get_mscale(yarn.factor)


def yarn_correction_range(yarn: Yarn, dim: int, theta: float) -> tuple[float, float]:
    """(low, high) dims of the ramp: where beta_fast and beta_slow rotations fit the original
    context, clipped to [0, dim - 1]."""

    def correction_dim(rotations: float) -> float:
        ctx = yarn.original_max_position_embeddings
        return (dim * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inv_freq(dim: int, theta: float, yarn: Yarn | None) -> np.ndarray:
    """[dim // 2] float32 inverse frequencies, in transformers' float32 order of operations."""
    if dim <= 0 or dim % 2:
        raise ValueError(f"RoPE needs a positive even qk_rope_head_dim, got {dim}")
    exponents_h = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    pos_freqs_h = np.float32(theta) ** exponents_h
    if yarn is None:
        return (np.float32(1.0) / pos_freqs_h).astype(np.float32)
    extrapolation_h = np.float32(1.0) / pos_freqs_h
    interpolation_h = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs_h)
    low, high = yarn_correction_range(yarn, dim, theta)
    if low == high:
        high += 0.001  # transformers: avoids a division by zero
    ramp_h = np.clip(
        (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
    )
    extrapolation_factor_h = np.float32(1.0) - ramp_h
    out_h: np.ndarray = (
        interpolation_h * (np.float32(1.0) - extrapolation_factor_h)
        + extrapolation_h * extrapolation_factor_h
    )
    return out_h.astype(np.float32)


def softmax_scale(qk_head_dim: int, yarn: Yarn | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim
    set (DeepseekV3Attention.scaling)."""
    scale: float = qk_head_dim**-0.5  # transformers: self.qk_head_dim ** (-0.5)
    if yarn is not None and yarn.mscale_all_dim:
        m = yarn_get_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_cos_sin(
    positions_BS: jax.Array, inv_freq_h: np.ndarray | Sequence[float], attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, R] float32 (frequencies repeated over both halves), times the YaRN
    attention factor."""
    freqs_h = jnp.asarray(np.asarray(inv_freq_h, np.float32))
    angles_BSh = positions_BS.astype(jnp.float32)[..., None] * freqs_h
    angles_BSR = jnp.concatenate([angles_BSh, angles_BSh], axis=-1)
    factor = jnp.float32(attention_factor)
    return jnp.cos(angles_BSR) * factor, jnp.sin(angles_BSR) * factor


def deinterleave(x_BSNR: jax.Array) -> jax.Array:
    """[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] on the last axis."""
    *lead, r = x_BSNR.shape
    return jnp.swapaxes(x_BSNR.reshape(*lead, r // 2, 2), -1, -2).reshape(*lead, r)


def apply_mla_rope(
    x_BSNR: jax.Array, cos_BSR: jax.Array, sin_BSR: jax.Array, *, interleave: bool
) -> jax.Array:
    """RoPE of the rotated part of q or k (f32 math, input dtype out); `interleave` first
    gathers the even then the odd dims, as transformers' apply_rotary_pos_emb_interleave."""
    if interleave:
        x_BSNR = deinterleave(x_BSNR)
    return apply_rope(x_BSNR, cos_BSR, sin_BSR)
