"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), by seed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moetext.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of most likely tokens whose probability reaches top_p."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")


def sample(logits_BV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """int32 [B] next tokens."""
    if s.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV.astype(jnp.float32) / s.temperature
    low = float(np.finfo(np.float32).min)
    if s.top_k and s.top_k < logits.shape[-1]:
        kth_B1 = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth_B1, low, logits)
    if s.top_p < 1:
        sorted_BV = jnp.sort(logits, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        # Keep a token when the mass before it is < top_p: the most likely token always stays.
        before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        kept = jnp.where(before_BV < s.top_p, sorted_BV, jnp.inf)
        threshold_B1 = jnp.min(kept, axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold_B1, low, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
