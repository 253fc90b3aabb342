"""`dot_rows`: a matmul of a few rows against a weight, as decoding runs them.

Legend: M rows, K contraction, N outputs.

A decode step multiplies one row per sequence by each weight. XLA:CPU hands a bf16 x bf16 dot
to YNNPACK, which reads bf16 operands directly, only when neither side is a vector (m, n >= 2);
a single-row dot falls to XLA's own codegen, which converts the whole weight to float32 first.
Inside the decode loop the compiler then hoists that conversion: a float32 copy of every such
weight (for the [151936, 2048] Qwen3 head, 1.2 GB written before the first token) and twice the
bytes read per step. `dot_rows` computes a single row as two (the row twice) and drops the copy;
on TPU, where an MXU pass costs the same for 1 or 8 rows, the duplicate is free.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def dot_rows(
    x_MK: jax.Array, w: jax.Array, *, w_contract: int, dtype: DTypeLike, out_dtype: DTypeLike
) -> jax.Array:
    """x_MK @ w in `dtype` with float32 accumulation, returned as out_dtype [M, N].

    w is 2-D, [K, N] (w_contract 0) or [N, K] (w_contract 1, e.g. an LM head [V, D])."""
    if x_MK.ndim != 2 or w.ndim != 2 or w_contract not in (0, 1):
        raise ValueError(
            f"dot_rows takes x [M, K] and a 2-D weight contracted on axis 0 or 1, got "
            f"x {x_MK.shape}, w {w.shape}, w_contract={w_contract}"
        )
    if x_MK.shape[1] != w.shape[w_contract]:
        raise ValueError(
            f"dot_rows: x has K={x_MK.shape[1]} but w {w.shape} has {w.shape[w_contract]} on "
            f"axis {w_contract}"
        )
    m = x_MK.shape[0]
    x = x_MK.astype(dtype)
    if m == 1:
        x = jnp.concatenate([x, x], axis=0)
    dims = (((1,), (w_contract,)), ((), ()))
    y_MN = jax.lax.dot_general(x, w.astype(dtype), dims, preferred_element_type=jnp.float32)
    # Rounded to the compute dtype first: the same values as a dot whose output is `dtype`.
    return y_MN[:m].astype(dtype).astype(out_dtype)
