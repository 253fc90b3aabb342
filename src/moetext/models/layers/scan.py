"""Layer stacks for model.scan_layers, shared by the families: runs of same-kind layers, each one
module with params stacked on a leading "layers" axis, remat policies, and the param-tree
conversion between the unscanned ("layers": {i: layer}) and scanned ("stacks": {j: run j})
layouts.

A family describes its stack by a per-layer pattern of kinds (for the decoders here: True where
a layer holds the MoE block); consecutive layers of one kind form one run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moetext.models.hf import ParamPath

REMAT_POLICIES = ("none", "full", "save_dots")


def segments(pattern: Sequence[bool]) -> tuple[tuple[bool, int], ...]:
    """Runs of consecutive layers of one kind: ((is_moe, count), ...) in layer order."""
    runs: list[tuple[bool, int]] = []
    for is_moe in pattern:
        if runs and runs[-1][0] == bool(is_moe):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((bool(is_moe), 1))
    return tuple(runs)


def check_remat_policy(policy: str) -> None:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat_policy {policy!r}; valid: {', '.join(REMAT_POLICIES)}")


def remat[F: Callable[..., Any]](fn: F, policy: str, *, in_scan: bool) -> F:
    """fn under model.remat_policy: none, full (recompute everything), save_dots (keep the
    projection and expert matmuls)."""
    # Inside scan the loop already separates iterations, so CSE prevention only costs speed.
    if policy == "none":
        return fn
    if policy == "full":
        out: F = jax.checkpoint(fn, prevent_cse=not in_scan)
        return out
    # Save projection/expert matmuls but not batched dots such as the [B,K,G,S,T] attention
    # scores, which are quadratic in sequence length.
    saver = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    out = jax.checkpoint(fn, policy=saver, prevent_cse=not in_scan)
    return out


def make_stack[M: nnx.Module](
    make_layer: Callable[[bool, jax.Array], M], kind: bool, keys: jax.Array
) -> M:
    """One layer of `kind` (make_layer(kind, key)) per key, params stacked on a leading
    "layers" axis."""
    create: Callable[[jax.Array], M] = nnx.vmap(
        lambda key: make_layer(kind, key),
        in_axes=0,
        out_axes=0,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return create(keys)


def stack_layers(params: dict[str, Any], pattern: Sequence[bool]) -> dict[str, Any]:
    """An unscanned decoder's param tree ("layers": {i: layer}) in the scan_layers layout
    ("stacks": {j: layers of run j stacked on a leading axis}); other entries unchanged.
    Works on nested dicts of arrays (jnp.stack: call it under jit to place the result). A tree
    holding some layers only (the model state: MoE layers' routers) keeps the runs it has."""
    layers = params["layers"]
    out = {k: v for k, v in params.items() if k != "layers"}
    stacks, start = {}, 0
    for j, (_, count) in enumerate(segments(pattern)):
        run = [layers[i] for i in range(start, start + count) if i in layers]
        if run:
            stacks[j] = jax.tree.map(lambda *xs: jnp.stack(xs), *run)
        start += count
    out["stacks"] = stacks
    return out


def stacked_path(path: ParamPath, pattern: Sequence[bool]) -> tuple[ParamPath, int | None]:
    """Where the unscanned param `path` lives in the scan_layers layout: (path in "stacks",
    index along the stacked axis), or (path, None) outside the layer stack."""
    if path[0] != "layers":
        return path, None
    i, start = int(path[1]), 0
    for j, (_, count) in enumerate(segments(pattern)):
        if i < start + count:
            return ("stacks", j, *path[2:]), i - start
        start += count
    raise ValueError(f"layer {i} is outside the {len(pattern)} layers")


def unstack_layers(params: dict[str, Any], pattern: Sequence[bool]) -> dict[str, Any]:
    """The inverse of `stack_layers`."""
    out = {k: v for k, v in params.items() if k != "stacks"}
    layers, start = {}, 0
    for j, (_, count) in enumerate(segments(pattern)):
        for k in range(count):
            if j in params["stacks"]:
                layers[start + k] = jax.tree.map(lambda x, k=k: x[k], params["stacks"][j])
        start += count
    out["layers"] = layers
    return out
