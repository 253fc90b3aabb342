"""Logical axis names -> mesh PartitionSpecs, and activation constraints under a rules context.

Layers name logical axes only ("batch", "embed", "exp", ...). A rule list maps each logical name
to a mesh axis, a list of mesh axes, or None (replicated):

    rules = [("batch", ["data", "fsdp"]), ("embed", "fsdp"), ("exp", "expert"), ("mlp", None)]
    with use_rules(mesh, rules):
        y = constrain(x, ("batch", "length", "embed"))   # with_sharding_constraint

Outside a `use_rules` context `constrain` is the identity, so models run unchanged on a laptop.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | Sequence[str] | None
Rules = Sequence[tuple[str, MeshAxes]]
# What `use_rules` activates: the mesh and its rules (frozen into a tuple).
Active = tuple[Mesh, tuple[tuple[str, MeshAxes], ...]]

_CURRENT: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
    "moetext_logical_rules", default=None
)


def as_axes(target: MeshAxes) -> tuple[str, ...]:
    """A rule target or PartitionSpec entry (an axis, a tuple of axes, None) as a tuple."""
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


def logical_to_mesh_spec(
    names: Sequence[str | None],
    rules: Rules,
    mesh_axis_names: Sequence[str] | None = None,
) -> PartitionSpec:
    """PartitionSpec for a tensor whose dims carry logical `names`.

    For each name the first rule whose mesh axes are all still unused in this spec wins (a mesh
    axis can shard only one dim); a name with no usable rule, or None, is replicated. When
    `mesh_axis_names` is given, mesh axes absent from it are ignored (a preset written for a
    bigger mesh still applies to a smaller one).
    """
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name in names:
        chosen: tuple[str, ...] = ()
        if name is not None:
            for logical, target in rules:
                if logical != name:
                    continue
                axes = as_axes(target)
                if mesh_axis_names is not None:
                    axes = tuple(a for a in axes if a in mesh_axis_names)
                if axes and not used.intersection(axes):
                    chosen = axes
                    break
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)  # type: ignore[no-untyped-call]  # jax: __new__ unannotated


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Activates `constrain` with this mesh and rules for code traced inside the block.

    The rules are read at trace time and jit's caches do not key on them: lower or first-call
    a jitted step inside the block (a function already traced outside keeps no constraints).
    """
    token = _CURRENT.set((mesh, tuple((name, target) for name, target in rules)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Active | None:
    """(mesh, rules) of the innermost active `use_rules`, or None."""
    return _CURRENT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint of x to its logical `names` under the active rules; else x."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    if len(names) != x.ndim:
        raise ValueError(f"logical names {tuple(names)} do not match the rank of shape {x.shape}")
    mesh, rules = ctx
    spec = logical_to_mesh_spec(names, rules, mesh.axis_names)
    sharding = NamedSharding(mesh, spec)
    # jax: with_sharding_constraint is unannotated (an untyped call returning Any).
    y: jax.Array = jax.lax.with_sharding_constraint(x, sharding)  # type: ignore[no-untyped-call]
    return y
