"""Rotary position embedding, rotate-half convention (as HF Qwen3/Llama).

Legend: B batch, S sequence, N heads, H head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(
    positions_BS: jax.Array, head_dim: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, H] float32 for integer positions; frequencies repeat over both halves."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_BSh = positions_BS.astype(jnp.float32)[..., None] * inv_freq
    angles_BSH = jnp.concatenate([angles_BSh, angles_BSh], axis=-1)
    return jnp.cos(angles_BSH), jnp.sin(angles_BSH)


def apply_rope(x_BSNH: jax.Array, cos_BSH: jax.Array, sin_BSH: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; f32 math, input dtype out."""
    x = x_BSNH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BSH[:, :, None, :], sin_BSH[:, :, None, :]
    return (x * cos + rotated * sin).astype(x_BSNH.dtype)
