"""`project`: a dense layer's matmul of batch-split tokens by an FSDP weight, per token shard
on a 3D TPU slice when `sharding.split_dense_gathers` is on (sharding/fsdp.py says when and why).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.gmm.gather import gather_weight
from moetext.sharding.fsdp import plan_for


def project(
    eq: str, x: jax.Array, w: jax.Array, w_names: Sequence[str | None], dtype: DTypeLike
) -> jax.Array:
    """jnp.einsum(eq, x, w.astype(dtype)) for tokens x split along dim 0 (which `eq` keeps as
    the output's dim 0) and a weight with logical axes `w_names`. On a mesh whose FSDP axes need
    the torus split (sharding/fsdp.py: `plan_for`), it runs per token shard in a shard_map over
    the split mesh, gathering w one sub-axis at a time and reduce-scattering its gradient the
    same way; else as written."""
    plan = plan_for(w, w_names)
    if plan is None:
        return jnp.einsum(eq, x, w.astype(dtype))
    gather = plan.gather
    out: jax.Array = jax.shard_map(
        lambda x_, w_: jnp.einsum(eq, x_, gather_weight(w_, gather, dtype)),
        mesh=plan.mesh,
        in_specs=(plan.tokens, plan.w_spec),
        out_specs=plan.tokens,
        # gather_weight's custom_vjp hides the all-gathers' replication from the vma checker;
        # the specs state it exactly.
        check_vma=False,
    )(x, w)
    return out
