"""The sharding plan of a run: mesh, rules, and a NamedSharding for every array it holds.

    plan = make_plan(cfg.sharding)                       # mesh + rules from the preset
    shardings = plan.shardings_for(abstract_state)       # checks names and divisibility
    state = jax.jit(create, out_shardings=shardings)()   # params born sharded
    with plan.rules(), record_logical_names() as names:  # activation constraints apply
        lowered = jitted_step.lower(state, batch)
    plan.check_names(names, "an activation")

Parameters carry their logical axes as nnx metadata (`out_sharding`, set by
`nnx.with_partitioning`); optimizer moments made by `jax.tree.map` over the params keep that
metadata, so the optimizer state is sharded exactly like the params without a second table.
Anything without logical names (step, counters, RNG) is replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeGuard

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moetext.config.schema import ShardingConfig
from moetext.errors import ConfigError
from moetext.sharding import fsdp, logical
from moetext.sharding.mesh import make_mesh
from moetext.sharding.rules import Preset, check_covered, resolve

# Metadata keys holding a Variable's logical axis names (flax 0.12 writes out_sharding).
_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")
# Tokens are [B, S + 1]: the extra target column makes S + 1 unshardable, so only B is split.
BATCH_NAMES = ("batch", None)


@dataclasses.dataclass(frozen=True)
class Plan:
    preset: Preset
    mesh: Mesh
    split_dense_gathers: bool = False  # ShardingConfig.split_dense_gathers (sharding/fsdp.py)

    @contextlib.contextmanager
    def rules(self) -> Iterator[None]:
        """The context under which jitted functions must be traced (activation constraints,
        and the dense layers' matmul form)."""
        with logical.use_rules(self.mesh, self.preset.rules):
            with fsdp.split_dense_gathers(self.split_dense_gathers):
                yield

    def spec(self, names: Sequence[str | None]) -> PartitionSpec:
        return logical.logical_to_mesh_spec(names, self.preset.rules, self.mesh.axis_names)

    def sharding(self, names: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(names))

    @property
    def replicated(self) -> NamedSharding:
        spec = PartitionSpec()  # type: ignore[no-untyped-call]  # jax: __new__ unannotated
        return NamedSharding(self.mesh, spec)

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.sharding(BATCH_NAMES)

    def check_names(self, names: Iterable[str | None], where: str) -> None:
        """ConfigError for a logical name without a rule in the preset (`where` names its user)."""
        check_covered(names, self.preset, where)

    def check_divides(self, field: str, value: int, name: str) -> None:
        """ConfigError when the mesh axes logical `name` maps to do not divide config `field`
        (e.g. model.num_heads over "heads"): one line naming both, before any param's shape
        does."""
        axes = self.spec((name,))[0]
        shards = _axes_size(self.mesh, axes)
        if value % shards:
            sizes = " x ".join(f"sharding.mesh.{a}" for a in logical.as_axes(axes))
            raise ConfigError(
                f"{field}={value} is not divisible by mesh axis {axes!r} of size {shards}, "
                f"which logical axis {name!r} maps to (preset {self.preset.name!r}, mesh "
                f"{dict(self.mesh.shape)}); pick {sizes} dividing {value}"
            )

    def shardings_for(self, tree: Any) -> Any:
        """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs, nnx Variables
        allowed), same structure; checks every logical name and every divisibility first."""
        return jax.tree_util.tree_map_with_path(self._leaf_sharding, tree, is_leaf=_is_variable)

    def _leaf_sharding(self, path: tuple[Any, ...], leaf: Any) -> Any:
        """A NamedSharding, or for an nnx Variable the Variable holding one (same metadata)."""
        if not _is_variable(leaf):
            return self.replicated
        if not jax.tree.leaves(leaf.get_value()):  # optax.masked's MaskedNode (train.freeze)
            return leaf
        names = logical_names(leaf)
        if names is None:
            return leaf.replace(value=self.replicated)
        where = f"param {path_str(path)}"
        shape = tuple(leaf.get_value().shape)
        if len(names) != len(shape):
            raise ValueError(f"{where}: logical names {names} do not match its shape {shape}")
        self.check_names(names, where)
        spec = self.spec(names)
        self._check_divisible(where, shape, names, spec)
        return leaf.replace(value=NamedSharding(self.mesh, spec))

    def _check_divisible(
        self,
        where: str,
        shape: tuple[int, ...],
        names: Sequence[str | None],
        spec: PartitionSpec,
    ) -> None:
        for dim, (size, name, axes) in enumerate(zip(shape, names, spec, strict=True)):
            shards = _axes_size(self.mesh, axes)
            if size % shards:
                raise ConfigError(
                    f"{where} of shape {shape}: dim {dim} (logical {name!r}, size {size}) is "
                    f"not divisible by mesh axis {axes!r} of size {shards} (preset "
                    f"{self.preset.name!r}, mesh {dict(self.mesh.shape)}); pick a mesh size "
                    f"that divides {size} or map {name!r} elsewhere"
                )


def make_plan(cfg: ShardingConfig, devices: Sequence[jax.Device] | None = None) -> Plan:
    """Resolves the preset and builds its mesh over `devices` (default: all devices)."""
    preset = resolve(cfg)
    return Plan(preset, make_mesh(preset, devices), cfg.split_dense_gathers)


def logical_names(var: nnx.Variable[Any]) -> tuple[str | None, ...] | None:
    """The Variable's logical axis names from its nnx metadata, or None when it has none."""
    meta = var.get_metadata()
    for key in _NAME_KEYS:
        names = meta.get(key)
        if isinstance(names, tuple | list) and all(n is None or isinstance(n, str) for n in names):
            return tuple(names)
    return None


@contextlib.contextmanager
def record_logical_names() -> Iterator[set[str | None]]:
    """Collects the logical names every `constrain` looks up while tracing inside the block
    (any `logical_to_mesh_spec` call made there, `Plan.spec` included, is recorded too).

    `logical.constrain` replicates a name without a rule; recording lets the trainer turn that
    into an error (a typo must not silently replicate an activation)."""
    seen: set[str | None] = set()
    original = logical.logical_to_mesh_spec

    def recording(
        names: Sequence[str | None],
        rules: logical.Rules,
        mesh_axis_names: Sequence[str] | None = None,
    ) -> PartitionSpec:
        seen.update(names)
        return original(names, rules, mesh_axis_names)

    logical.logical_to_mesh_spec = recording
    try:
        yield seen
    finally:
        logical.logical_to_mesh_spec = original


def path_str(path: Iterable[object]) -> str:
    """params.layers.0.attn.w_q for a pytree key path."""
    parts: list[str] = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def describe(plan: Plan) -> str:
    """One line: preset and mesh, for logs."""
    shape = " x ".join(f"{a}={n}" for a, n in plan.mesh.shape.items())
    return f"sharding preset {plan.preset.name!r}, mesh {shape}"


def _axes_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def _is_variable(x: object) -> TypeGuard[nnx.Variable[Any]]:
    return isinstance(x, nnx.Variable)
