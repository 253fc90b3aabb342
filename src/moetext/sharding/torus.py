"""Mesh axes that XLA:TPU can reduce-scatter and all-gather over: at most two torus dims each,
and not a whole square 2D slice.

XLA:TPU lowers a reduce-scatter whose device group spans all three dims of a v5p torus
(v5p:2x2x2 and larger: every FSDP axis over a whole 3D slice) as an all-reduce of the full
operand plus a dynamic-slice, and on v5p:4x4x4 and larger an all-gather as an all-reduce too. An
all-reduce moves about twice the bytes of either, and in place of a reduce-scatter it holds the
full-size operand; a group spanning one or two torus dims keeps the real collective, with one
exception below. (Compiled with libtpu for v5p:2x2x1/2x2x2/4x4x2/4x4x4/8x4x4,
docs/performance.md "Expert-weight gradients".) The exception: a reduce-scatter over a whole
square 2D slice of side 4 or more (v5e/v6e 4x4, 8x8, 16x16, v5p:4x4x1) is an all-reduce too,
though the same group inside a larger slice (a 4 x 4 plane of v5p:4x4x4), a non-square one
(v6e:8x16) or part of a slice (a 4 x 8 half of v6e:8x8) keeps the reduce-scatter
(docs/sharding.md, "3D TPU slices").

`split_for_collectives` therefore describes the same devices with each such mesh axis split in
two, an outer and an inner axis that each span at most two torus dims and neither a whole square
slice. A shard_map over the split mesh whose collectives run one axis at a time
(kernels/gmm/gather.py) gets two real reduce-scatters (all-gathers) where the one over the whole
axis became an all-reduce. Arrays keep their layout: the split axis `a` is the pair (a_outer,
a_inner) in the same device order, so P("a") and P(("a_outer", "a_inner")) place every shard on
the same device.

Only explicit per-axis collectives get split: the experts' (models/moe/ep.py) and, with
`sharding.split_dense_gathers`, the dense layers' (sharding/fsdp.py), which also run one mesh
axis at a time where a weight split over several axes needs it (`needs_split_jointly`).
GSPMD's own gathers stay one collective over the whole group even on the split mesh, sharded
over both axes: it merges them. By the compiler's own algorithm choice that may cost no more
link time: the all-reduce it emits there runs on one ring per link direction (six on
v5p:4x4x4, "colors:6" in the HLO) where per-axis all-gathers use a 1D emitter
(docs/sharding.md, "3D TPU slices").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, PartitionSpec

# A collective's device group may span this many torus dims before XLA:TPU lowers it as an
# all-reduce.
MAX_TORUS_DIMS = 2
# ... and, spanning two, be a whole square slice of a side below this.
MIN_SQUARE_SIDE = 4

Renames = dict[str, tuple[str, ...]]


def torus_dims(devices: Sequence[object]) -> int:
    """How many physical torus dims (x, y, z coordinates) vary over `devices`; 0 for devices
    without coordinates (CPU)."""
    coords = [getattr(d, "coords", None) for d in devices]
    if not coords or any(c is None for c in coords):
        return 0
    arr = np.asarray(coords)
    return int(np.sum(arr.min(axis=0) != arr.max(axis=0)))


def _lines(devices: np.ndarray, k: int | Sequence[int]) -> list[list[object]]:
    """Every run of devices along mesh axis k, or along all of the axes k (the other mesh
    indices fixed): one group per combination of the other indices."""
    ks = [k] if isinstance(k, int) else list(k)
    moved = np.moveaxis(devices, ks, list(range(-len(ks), 0)))
    return [list(row) for row in moved.reshape(-1, math.prod(moved.shape[-len(ks) :]))]


def _whole_square_slice(group: Sequence[Any], slice_size: int) -> bool:
    """Whether `group` is all slice_size devices of one slice (the mesh's devices that share a
    `slice_index`) and those sit on a 2D square of n x n chips, n >= MIN_SQUARE_SIDE (chips
    counted by their coordinates: a chip with two cores is two devices on one chip)."""
    if len(group) != slice_size or torus_dims(group) != 2:
        return False
    if len({getattr(d, "slice_index", 0) for d in group}) != 1:
        return False
    chips = {tuple(d.coords) for d in group}
    arr = np.asarray(sorted(chips))
    extents = [int(e) for e in arr.max(axis=0) - arr.min(axis=0) + 1 if e > 1]
    return extents[0] == extents[1] >= MIN_SQUARE_SIDE and len(chips) == extents[0] ** 2


def _needs_split(group: Sequence[object], slice_size: int) -> bool:
    """Whether XLA:TPU lowers a reduce-scatter over `group` (of a slice of slice_size chips)
    as an all-reduce: three torus dims spanned, or a whole square 2D slice."""
    return torus_dims(group) > MAX_TORUS_DIMS or _whole_square_slice(group, slice_size)


def _inner_size(lines: list[list[object]], slice_size: int) -> int | None:
    """The largest inner size b (outer n / b) for which no block of b consecutive devices and
    no stride-b group of any line needs a split (_needs_split); None when no whole line needs
    one or no split helps."""
    n = len(lines[0])
    if not any(_needs_split(line, slice_size) for line in lines):
        return None
    for b in sorted((b for b in range(2, n) if n % b == 0), reverse=True):
        ok = not any(
            _needs_split(line[i : i + b], slice_size) or _needs_split(line[j::b], slice_size)
            for line in lines
            for i in range(0, n, b)
            for j in range(b)
        )
        if ok:
            return b
    return None


def _gather_needs_split(group: Sequence[Any]) -> bool:
    """Whether XLA:TPU lowers an all-gather over `group` as an all-reduce: the group spans
    three torus dims, each at least MIN_SQUARE_SIDE chips long (v5p:4x4x4, 4x4x8, 8x4x4,
    tpu7x:4x4x4; v5p:2x2x2, 2x4x4 and 4x4x2 keep the all-gather; docs/performance.md, the
    table under "Expert-weight gradients")."""
    if torus_dims(group) <= MAX_TORUS_DIMS:
        return False
    arr = np.asarray([d.coords for d in group])
    return bool(np.all(arr.max(axis=0) - arr.min(axis=0) + 1 >= MIN_SQUARE_SIDE))


def gathers_whole(mesh: Mesh, axes: Iterable[str]) -> bool:
    """Whether an all-gather over all of `axes` at once (every group of devices that differ
    only along them) stays an all-gather on XLA:TPU; True off TPU. Where it does, an axis
    split by `split_for_collectives` (for its reduce-scatters) can still be gathered in one
    collective (kernels/gmm/gather.py, `WeightGather.jointly`)."""
    names = list(mesh.axis_names)
    ks = [names.index(a) for a in dict.fromkeys(axes)]
    return not ks or not any(_gather_needs_split(g) for g in _lines(mesh.devices, ks))


def _slice_size(devices: np.ndarray) -> int:
    """Devices per slice (those sharing a `slice_index`; one slice without it)."""
    return devices.size // len({getattr(d, "slice_index", 0) for d in devices.flat})


def needs_split_jointly(mesh: Mesh, axes: Iterable[str]) -> bool:
    """Whether a reduce-scatter over all of `axes` at once (each group of devices that differ
    only along them) would run as an all-reduce (three torus dims, or a whole square 2D slice),
    as over fsdp x expert under fsdp_ep on a whole 3D slice, where neither axis alone needs
    `split_for_collectives`: collectives one axis at a time keep it real."""
    names, devices = list(mesh.axis_names), mesh.devices
    ks = [names.index(a) for a in dict.fromkeys(axes) if mesh.shape[a] > 1]
    return len(ks) > 1 and any(_needs_split(g, _slice_size(devices)) for g in _lines(devices, ks))


def split_for_collectives(mesh: Mesh, axes: Iterable[str]) -> tuple[Mesh, Renames]:
    """(mesh', renames): `mesh` with each of `axes` that spans three torus dims or a whole
    square 2D slice split into (axis_outer, axis_inner), each spanning at most two dims and
    neither a whole square slice, same devices in the same order; renames maps each split axis
    to its pair. Unchanged (and {}) where nothing needs splitting: CPU devices, one-dim and
    non-square two-dim slices, axes already within two torus dims."""
    names, devices = list(mesh.axis_names), mesh.devices
    slice_size = _slice_size(devices)
    renames: Renames = {}
    for axis in dict.fromkeys(axes):
        k = names.index(axis)
        if devices.shape[k] <= 1:
            continue
        b = _inner_size(_lines(devices, k), slice_size)
        if b is None:
            continue
        shape = devices.shape[:k] + (devices.shape[k] // b, b) + devices.shape[k + 1 :]
        devices = devices.reshape(shape)
        pair = (f"{axis}_outer", f"{axis}_inner")
        names[k : k + 1] = list(pair)
        renames[axis] = pair
    if not renames:
        return mesh, {}
    types = zip(mesh.axis_names, mesh.axis_types, strict=True)
    axis_types = tuple(t for a, t in types for _ in renames.get(a, (a,)))
    return Mesh(devices, tuple(names), axis_types=axis_types), renames


def rename_axes(axes: Iterable[str], renames: Renames) -> tuple[str, ...]:
    """Mesh axis names with each split axis replaced by its (outer, inner) pair."""
    return tuple(n for a in axes for n in renames.get(a, (a,)))


def rename_spec(spec: PartitionSpec, renames: Renames) -> PartitionSpec:
    """A PartitionSpec of the original mesh as the same layout on the split mesh."""
    if not renames:
        return spec
    entries: list[str | tuple[str, ...] | None] = []
    for entry in spec:
        if entry is None:
            entries.append(None)
            continue
        axes = rename_axes((entry,) if isinstance(entry, str) else tuple(entry), renames)
        entries.append(axes[0] if len(axes) == 1 else axes)
    out: PartitionSpec = PartitionSpec(*entries)  # type: ignore[no-untyped-call]  # jax: PartitionSpec.__new__ unannotated
    return out
