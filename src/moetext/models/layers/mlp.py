"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

Legend: B batch, S sequence, D emb_dim, F intermediate (any leading axes work).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.typing import DTypeLike

from moetext.models.layers.params import make_param, normal
from moetext.models.layers.project import project


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
        self.in_names, self.out_names = ("embed", axis), (axis, "embed")
        init = normal(init_std)
        self.w_gate = make_param(rngs, init, (emb_dim, hidden_dim), self.in_names, param_dtype)
        self.w_up = make_param(rngs, init, (emb_dim, hidden_dim), self.in_names, param_dtype)
        self.w_down = make_param(rngs, init, (hidden_dim, emb_dim), self.out_names, param_dtype)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x = x_BSD.astype(self.dtype)
        gate_BSF = project("...d,df->...f", x, self.w_gate[...], self.in_names, self.dtype)
        up_BSF = project("...d,df->...f", x, self.w_up[...], self.in_names, self.dtype)
        h_BSF = jax.nn.silu(gate_BSF) * up_BSF
        return project("...f,fd->...d", h_BSF, self.w_down[...], self.out_names, self.dtype)
