"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

Legend: B batch, S sequence, D emb_dim, F intermediate (any leading axes work).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from moetext.models.layers.params import make_param, normal


class SwiGLU(nnx.Module):
    """Dense SwiGLU MLP; `axis` names the intermediate logical axis ("mlp" by default)."""

    def __init__(
        self,
        emb_dim: int,
        hidden_dim: int,
        *,
        init_std: float,
        param_dtype: DTypeLike,
        dtype: DTypeLike,
        rngs: nnx.Rngs,
        axis: str = "mlp",
    ):
        self.dtype = dtype
        init = normal(init_std)
        self.w_gate = make_param(rngs, init, (emb_dim, hidden_dim), ("embed", axis), param_dtype)
        self.w_up = make_param(rngs, init, (emb_dim, hidden_dim), ("embed", axis), param_dtype)
        self.w_down = make_param(rngs, init, (hidden_dim, emb_dim), (axis, "embed"), param_dtype)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x = x_BSD.astype(self.dtype)
        gate_BSF = jnp.einsum("...d,df->...f", x, self.w_gate[...].astype(self.dtype))
        up_BSF = jnp.einsum("...d,df->...f", x, self.w_up[...].astype(self.dtype))
        h_BSF = jax.nn.silu(gate_BSF) * up_BSF
        return jnp.einsum("...f,fd->...d", h_BSF, self.w_down[...].astype(self.dtype))
