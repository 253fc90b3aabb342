"""FSDP matmuls for the dense layers whose collectives stay real on 3D TPU slices.

A dense layer (attention, a dense MLP, the router) multiplies batch-split tokens by a weight
stored split over the same axes (`embed -> fsdp`) and leaves the FSDP gather to GSPMD, which
all-gathers the weight and reduce-scatters its gradient as one collective over the whole axis.
Where that axis spans all three dims of a v5p torus, XLA:TPU lowers such a reduce-scatter
(v5p:2x2x2 and larger) and, on v5p:4x4x4 and larger, the all-gather itself as an all-reduce of
the full weight; over a whole square 2D slice (v6e 4x4 to 16x16) the reduce-scatter too
(sharding/torus.py, docs/sharding.md).

`models.layers.project.project` makes the matmul explicit there, on the plan made here: a
`jax.shard_map` over the run's mesh with those axes split into (outer, inner) pairs of at most
two torus dims (same devices, same shards), in which each token shard all-gathers the weight one
sub-axis at a time (`kernels.gmm.gather.gather_weight`: cast to the compute dtype first, so the
wire carries bf16) and multiplies its own tokens; the weight gradient, computed per shard, is
reduce-scattered per sub-axis in the weight's dtype (f32 for f32 master weights), as the
experts' is. The fused loss's LM head (train/loss.py) takes the same plan, a vocab chunk at a
time, its gradient reduced in the compute dtype (the head is cast before the loss, as without
the option).

It applies inside `split_dense_gathers(True)` (config `sharding.split_dense_gathers`, entered
by `Plan.rules`) when the weight is split over exactly the mesh axes that split the tokens
(the fsdp preset; fsdp_ep, whose non-expert weights are split over fsdp x expert; fsdp_tp
with tensor = 1) and the sequence is not split. A weight split over several mesh axes that
need no split each but do together (fsdp x expert spanning three torus dims, or a whole square
2D slice: `torus.needs_split_jointly`) is gathered one axis at a time on the unsplit mesh.
Everywhere else (the default, no rules context, CPU, one-dim and non-square two-dim slices,
tensor parallelism of size > 1) it is `jnp.einsum(eq, x, w.astype(dtype))` and GSPMD decides.

Why it is off by default: which form is faster is not known without a TPU. GSPMD's all-reduce
runs on six rings at once over a v5p:4x4x4 (the compiler's `collective_algorithm_config`),
while the per-axis all-gathers use 1D emitters, so by link count the all-reduce may cost no
more (docs/sharding.md, "3D TPU slices"); the AOT figures of both are in docs/performance.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from moetext.sharding import logical, torus

TOKEN_NAMES = ("batch", "length")
# ((dim, (mesh axis, ...)), ...), as kernels.gmm.gather.Gather (sharding does not import kernels).
Gather = tuple[tuple[int, tuple[str, ...]], ...]
_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("moetext_split_dense", default=False)


@contextlib.contextmanager
def split_dense_gathers(on: bool) -> Iterator[None]:
    """`plan_for` makes plans (the dense matmuls take the per-axis shard_map form) inside this
    block when `on` and the mesh needs the split."""
    token = _SPLIT.set(on)
    try:
        yield
    finally:
        _SPLIT.reset(token)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a per-token-shard matmul against an FSDP weight runs (all static)."""

    mesh: Mesh  # the run's mesh with the weight's axes split (sharding/torus.py)
    gather: Gather  # the weight's (dim, sub-axes) pairs, gathered in this order
    w_spec: PartitionSpec  # the weight's layout on `mesh`
    tokens: PartitionSpec  # dim 0 of the tokens (and of the result) split over the batch axes


def plan_for(w: jax.Array, names: Sequence[str | None]) -> ShardPlan | None:
    """The shard_map form for weight `w` (logical axes `names`), or None where GSPMD keeps the
    matmul: outside `split_dense_gathers(True)` or a rules context, where the weight is not
    split over exactly the tokens' mesh axes, and where the mesh needs no split."""
    ctx = logical.current()
    if ctx is None or not _SPLIT.get():
        return None
    if len(names) != w.ndim:
        raise ValueError(f"logical names {tuple(names)} do not match the rank of shape {w.shape}")
    mesh, rules = ctx
    spec = logical.logical_to_mesh_spec(names, rules, mesh.axis_names)
    tokens = logical.logical_to_mesh_spec(TOKEN_NAMES, rules, mesh.axis_names)
    token_axes = [a for entry in tokens for a in logical.as_axes(entry) if mesh.shape[a] > 1]
    if any(mesh.shape[a] > 1 for a in logical.as_axes(tokens[1])):
        # Sequence-split tokens: the [B, S, ...] inputs' dim 0 is not their only split dim.
        return None
    w_axes = [a for entry in spec for a in logical.as_axes(entry) if mesh.shape[a] > 1]
    # The per-shard matmul is the whole story only when the weight is split over exactly the
    # axes that split the tokens (pure FSDP): then gathering it makes the matmul local, and
    # reduce-scattering its gradient sums every token shard's part.
    if sorted(w_axes) != sorted(token_axes):
        return None
    split, renames = torus.split_for_collectives(mesh, w_axes)
    if not renames and not torus.needs_split_jointly(mesh, w_axes):
        return None
    # Only axes of size > 1 are gathered (a weight may name size-1 ones, e.g. vocab -> tensor
    # under fsdp_tp with tensor = 1).
    per_dim = [
        (
            dim,
            tuple(
                a for a in torus.rename_axes(logical.as_axes(entry), renames) if split.shape[a] > 1
            ),
        )
        for dim, entry in enumerate(spec)
    ]
    gather: Gather = tuple((dim, axes) for dim, axes in per_dim if axes)
    tok = torus.rename_axes(tuple(a for entry in tokens for a in logical.as_axes(entry)), renames)
    # Size-1 axes the tokens do not name are named too (no change of layout): shard_map's
    # transpose would otherwise psum the tokens' cotangent over them, a no-op all-reduce each.
    tok += tuple(a for a in split.axis_names if split.shape[a] == 1 and a not in tok)
    tok_spec = PartitionSpec(tok or None)  # type: ignore[no-untyped-call]  # jax: PartitionSpec.__new__ unannotated
    return ShardPlan(split, gather, torus.rename_spec(spec, renames), tok_spec)
