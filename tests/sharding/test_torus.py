"""moetext.sharding.torus: mesh axes split so that no collective's device group spans three
torus dims or a whole square 2D slice (XLA:TPU lowers such reduce-scatters, and on large 3D
slices all-gathers, as all-reduces).

Pure logic on devices that only carry coordinates, then the split of real v5p/v6e topologies'
meshes (libtpu describes the chips; nothing compiles). The compiled collectives of the train
step on a split mesh: test_aot.py.
"""

import itertools
import re
from types import SimpleNamespace

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moetext import hlo
from moetext.sharding import torus


def chips(*shape: int) -> list[SimpleNamespace]:
    """Devices of an x-fastest torus of the given shape, coordinates only."""
    return [
        SimpleNamespace(coords=[x, y, z])
        for z, y, x in itertools.product(*(range(n) for n in reversed(shape)))
    ]


def test_torus_dims_counts_the_coordinates_that_vary():
    cube = chips(2, 2, 2)
    assert torus.torus_dims(cube) == 3
    assert torus.torus_dims(cube[:4]) == 2  # the z = 0 plane
    assert torus.torus_dims(cube[::4]) == 1  # x = y = 0, z varies
    assert torus.torus_dims([SimpleNamespace(id=0), SimpleNamespace(id=1)]) == 0  # CPU: none


def test_inner_size_splits_a_3d_line_into_planes_and_lines():
    assert torus._inner_size([chips(2, 2, 2)], 8) == 4  # 2 planes of 2 x 2
    assert torus._inner_size([chips(4, 4, 2)], 32) == 16  # 2 planes of 4 x 4
    assert torus._inner_size([chips(2, 2, 1)], 4) is None  # already within two dims
    assert torus._inner_size([chips(8, 1, 1)], 8) is None


def test_inner_size_splits_a_whole_square_2d_slice_into_halves():
    # XLA:TPU reduce-scatters over a whole n x n slice (n >= 4) as an all-reduce.
    assert torus._inner_size([chips(4, 4, 1)], 16) == 8  # 2 halves of 4 x 2
    assert torus._inner_size([chips(16, 16, 1)], 256) == 128
    assert torus._inner_size([chips(8, 16, 1)], 128) is None  # not square
    assert torus._inner_size([chips(2, 2, 1)], 4) is None  # side 2
    # A 4 x 4 plane that is not the whole slice (of a 4x4x4, or one of several data slices)
    # keeps its reduce-scatter.
    assert torus._inner_size([chips(4, 4, 1)], 64) is None
    # Two cores per chip: 32 devices on 4 x 4 chips are the whole square slice.
    two_core = [d for c in chips(4, 4, 1) for d in (c, SimpleNamespace(coords=c.coords))]
    assert torus._inner_size([two_core], 32) == 16
    # Halves of two slices (slice_index 0 and 1) are not one slice.
    halves = [
        SimpleNamespace(coords=c.coords, slice_index=i // 8) for i, c in enumerate(chips(4, 4, 1))
    ]
    assert torus._inner_size([halves], 16) is None


def test_rename_spec_keeps_the_layout():
    renames = {"fsdp": ("fsdp_outer", "fsdp_inner")}
    assert torus.rename_spec(P(None, "fsdp", None), renames) == P(
        None, ("fsdp_outer", "fsdp_inner"), None
    )
    assert torus.rename_spec(P(("data", "fsdp"), "tensor"), renames) == P(
        ("data", "fsdp_outer", "fsdp_inner"), "tensor"
    )
    assert torus.rename_axes(("data", "fsdp", "expert"), renames) == (
        "data",
        "fsdp_outer",
        "fsdp_inner",
        "expert",
    )
    assert torus.rename_spec(P("fsdp"), {}) == P("fsdp")


def _fsdp_mesh(topology: str):
    from moetext import aot
    from moetext.sharding import load_preset, make_mesh

    devices = aot.tpu_devices(topology)
    return make_mesh(load_preset("fsdp"), devices)


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    ("topology", "split"),
    [
        ("v5p:2x2x1", None),  # a 2 x 2 slice: nothing to split
        ("v6e:8x16", None),  # not square
        ("v6e:4x4", (2, 8)),  # a whole square 2D slice: halves
        ("v6e:16x16", (2, 128)),
        ("v5p:4x4x1", (2, 8)),
        ("v5p:2x2x2", (2, 4)),
        ("v5p:4x4x2", (4, 8)),
        ("v5p:8x4x4", (8, 16)),
    ],
)
def test_split_of_real_topologies_keeps_every_shard_on_its_device(topology, split):
    mesh = _fsdp_mesh(topology)
    out, renames = torus.split_for_collectives(mesh, ["fsdp"])
    if split is None:
        assert out is mesh and renames == {}
        return
    assert renames == {"fsdp": ("fsdp_outer", "fsdp_inner")}
    assert (out.shape["fsdp_outer"], out.shape["fsdp_inner"]) == split
    np.testing.assert_array_equal(out.devices.reshape(mesh.devices.shape), mesh.devices)
    for axis in ("fsdp_inner", "fsdp_outer"):
        lines = torus._lines(out.devices, out.axis_names.index(axis))
        assert not any(torus._needs_split(line, mesh.size) for line in lines), axis


def _scatter_ops(mesh, dtype: str = "float32") -> set[str]:
    """The collective ops of a compiled reduce-scatter of each device's [4096, 4096] partial
    sum over every fsdp device of `mesh`, one fsdp mesh axis at a time."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from moetext.kernels.gmm.gather import psum_scatter_dims

    axes = tuple(a for a in mesh.axis_names if a.startswith("fsdp"))

    def scatter(parts):
        return jax.shard_map(
            lambda x: psum_scatter_dims(x[0], ((0, axes),)),
            mesh=mesh,
            in_specs=P(axes),
            out_specs=P(axes),
        )(parts)

    parts = jax.ShapeDtypeStruct(
        (mesh.size, 4096, 4096), jnp.dtype(dtype), sharding=NamedSharding(mesh, P(axes))
    )
    text = jax.jit(scatter).lower(parts).compile().as_text() or ""
    return {op for op, _ in hlo.collectives(text, by="shape")}


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    ("topology", "dtype"),
    [("v6e:8x8", "float32"), ("v6e:8x8", "bfloat16"), ("v5p:4x4x1", "float32")],
)
def test_reduce_scatter_over_a_whole_square_2d_slice_needs_the_split(topology, dtype):
    # The compiler behaviour behind torus._whole_square_slice: over all 64 (16) chips the
    # reduce-scatter is an all-reduce of the whole operand; over the split mesh (two halves,
    # then pairs) it stays a reduce-scatter.
    mesh = _fsdp_mesh(topology)
    assert _scatter_ops(mesh, dtype) == {"all-reduce"}
    split, renames = torus.split_for_collectives(mesh, ["fsdp"])
    assert renames and "all-reduce" not in _scatter_ops(split, dtype)


def _gather_ops(mesh, steps: list[P]) -> list[str]:
    """The collectives (op and algorithm) of a compiled program that gathers a weight sharded
    over every fsdp device through each of `steps` in turn, the last P() (replicated)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    fsdp = tuple(a for a in mesh.axis_names if a.startswith("fsdp"))

    def gather(w):
        for spec in steps:
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))
        return w * 2

    # 64 MiB: small all-reduces take a latency-bound algorithm instead.
    w = jax.ShapeDtypeStruct((mesh.size * 128, 4096), jnp.bfloat16)
    jitted = jax.jit(gather, in_shardings=NamedSharding(mesh, P(fsdp, None)))
    text = jitted.lower(w).compile().as_text() or ""
    ops = re.findall(r"= \S+ (all-gather|all-reduce|reduce-scatter)(?:-start)?\(.*", text)
    colors = re.findall(r"= \S+ all-reduce(?:-start)?\(.*colors:(\d+)", text)
    return ops + [f"colors:{c}" for c in colors]


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    ("topology", "ops"),
    [
        ("v5p:4x4x2", ["all-gather"]),  # three dims, one of them 2 long: a real all-gather
        # Every dim 4 long: XLA:TPU rewrites the gather as an all-reduce of the zero-padded
        # weight run on six rings at once (one per link direction; its 1D gathers use one).
        ("v5p:4x4x4", ["all-reduce", "colors:6"]),
    ],
)
def test_gspmd_gathers_over_a_whole_4x4x4_torus_become_all_reduces(topology, ops):
    # The compiler behaviour that docs/sharding.md ("3D TPU slices") rests on: a libtpu that
    # changes it should fail here first.
    assert _gather_ops(_fsdp_mesh(topology), [P()]) == ops


@pytest.mark.tpu_aot
def test_gathering_one_split_axis_at_a_time_keeps_all_gathers():
    # Sharding over both split axes is not enough: GSPMD gathers over their union in one op
    # (an all-reduce again). A constraint per axis gives two all-gathers.
    mesh, _ = torus.split_for_collectives(_fsdp_mesh("v5p:4x4x4"), ["fsdp"])
    assert _gather_ops(mesh, [P()]) == ["all-reduce", "colors:6"]
    assert _gather_ops(mesh, [P("fsdp_outer"), P()]) == ["all-gather", "all-gather"]


def test_gather_needs_the_split_only_over_three_dims_each_four_long():
    # XLA:TPU's rule for all-gathers (the table above): an all-reduce over v5p:4x4x4 and
    # larger, a real all-gather over a 3D group with a dim of 2, and over any 2D one.
    assert torus._gather_needs_split(chips(4, 4, 4))
    assert torus._gather_needs_split(chips(8, 4, 4))
    assert not torus._gather_needs_split(chips(4, 4, 2))
    assert not torus._gather_needs_split(chips(2, 4, 4))
    assert not torus._gather_needs_split(chips(2, 2, 2))
    assert not torus._gather_needs_split(chips(16, 16, 1))
    assert not torus._gather_needs_split([SimpleNamespace(id=i) for i in range(64)])  # CPU


def _joint_gather_ops(topology: str) -> tuple[bool, list[str]]:
    """(torus.gathers_whole of the fsdp axis, the collective ops of a compiled shard_map that
    all-gathers a 64 MiB bf16 weight over both halves of the split fsdp axis in one
    collective, as gmm does with gather_jointly)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from moetext.kernels.gmm.gather import all_gather_dims

    mesh = _fsdp_mesh(topology)
    split, renames = torus.split_for_collectives(mesh, ["fsdp"])
    pair = renames["fsdp"]
    gather = jax.shard_map(
        lambda w: all_gather_dims(w, ((0, pair),), jointly=True) * 2,
        mesh=split,
        in_specs=P(pair),
        out_specs=P(),
        check_vma=False,
    )
    w = jax.ShapeDtypeStruct(
        (mesh.size * 128, 4096), jnp.bfloat16, sharding=NamedSharding(split, P(pair))
    )
    text = jax.jit(gather).lower(w).compile().as_text() or ""
    ops = re.findall(r"= \S+ (all-gather|all-reduce)(?:-start)?\(", text)
    return torus.gathers_whole(mesh, ["fsdp"]), ops


@pytest.mark.tpu_aot
@pytest.mark.parametrize(
    ("topology", "whole", "ops"),
    [("v5p:4x4x2", True, ["all-gather"]), ("v5p:4x4x4", False, ["all-reduce"])],
)
def test_a_split_axis_is_gathered_in_one_collective_where_that_stays_an_all_gather(
    topology, whole, ops
):
    # models/moe/ep.py gathers the experts' weights over both halves of a split fsdp axis at
    # once exactly where torus.gathers_whole says so: there the compiled gather is one
    # all-gather; on v5p:4x4x4 it would be an all-reduce, so the gather stays per half.
    assert _joint_gather_ops(topology) == (whole, ops)


def _dense_step_ops(
    topology: str, split_dense: bool, preset_name: str = "fsdp", expert: int = 1
) -> set[tuple[str, str]]:
    """The (op, result shapes) of the collectives of the compiled forward + backward of two
    FSDP dense projections and the fused LM-head loss under a preset's rules (fsdp_ep with
    `expert` expert shards), with sharding.split_dense_gathers on or off."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from moetext import aot
    from moetext.models.layers.project import project
    from moetext.program.loss import fused_masked_nll
    from moetext.sharding import fsdp, load_preset, logical, make_mesh

    preset = load_preset(preset_name)
    preset = dataclasses.replace(preset, mesh={**preset.mesh, "expert": expert})
    mesh = make_mesh(preset, aot.tpu_devices(topology))
    d, f, v, t = 8192, 4096, 8192, 16 * mesh.size  # a 64 MiB bf16 weight, as above

    def loss(x, w, head, targets):
        y = project("td,df->tf", x, w, ("embed", "mlp"), jnp.bfloat16)
        h = project("tf,df->td", y, w, ("embed", "mlp"), jnp.bfloat16)
        nll, _ = fused_masked_nll(
            h[None], head, targets[None], jnp.ones_like(targets)[None], chunk_size=2048
        )
        return nll

    def spec(names):
        return NamedSharding(mesh, logical.logical_to_mesh_spec(names, preset.rules))

    args = (
        jax.ShapeDtypeStruct((t, d), jnp.bfloat16, sharding=spec(("batch", "embed"))),
        jax.ShapeDtypeStruct((d, f), jnp.float32, sharding=spec(("embed", "mlp"))),
        jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=spec(("vocab", "embed"))),
        jax.ShapeDtypeStruct((t,), jnp.int32, sharding=spec(("batch",))),
    )
    with logical.use_rules(mesh, preset.rules), fsdp.split_dense_gathers(split_dense):
        compiled = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(*args).compile()
    return {(op, shape) for (op, shape) in hlo.collectives(compiled.as_text() or "", by="shape")}


@pytest.mark.tpu_aot
def test_split_dense_gathers_keeps_the_weight_gathers_all_gathers_on_a_4x4x4_torus():
    # GSPMD (the default) gathers the projection's weight and each LM-head vocab chunk over
    # all 64 chips as all-reduces of the full array. With sharding.split_dense_gathers they are
    # all-gathers, one split axis at a time, and the gradients reduce-scatters per axis.
    full_w, full_chunk = "bf16[8192,4096]", "bf16[2048,1,8192]"
    off = _dense_step_ops("v5p:4x4x4", split_dense=False)
    assert {("all-reduce", full_w), ("all-reduce", full_chunk)} <= off, sorted(off)
    on = _dense_step_ops("v5p:4x4x4", split_dense=True)
    assert {("all-gather", full_w), ("all-gather", full_chunk)} <= on, sorted(on)
    # The gradients' inner (16-chip) stage: the weight's, and the LM-head chunk's, computed as
    # [D, C] so that D, the dim scattered, is major (scattered along the minor dim of a [C, D]
    # it ran as an all-reduce of the chunk and a slice).
    assert {("reduce-scatter", "f32[128,4096]"), ("reduce-scatter", "bf16[128,2048]")} <= on
    assert not [s for op, s in on if op == "all-reduce"], sorted(on)


@pytest.mark.tpu_aot
def test_split_dense_gathers_gathers_fsdp_ep_dense_weights_one_axis_at_a_time():
    # fsdp_ep splits the dense weights over fsdp x expert (16 x 4 on v5p:4x4x4): each axis
    # spans at most two torus dims, so neither is split, but together they span all three and
    # GSPMD all-reduces the weight. split_dense_gathers gathers over expert, then fsdp: all
    # all-gathers, the gradients reduce-scattered per axis, no all-reduce of a weight.
    full_w = "bf16[8192,4096]"
    off = _dense_step_ops("v5p:4x4x4", False, "fsdp_ep", expert=4)
    assert ("all-reduce", full_w) in off, sorted(off)
    on = _dense_step_ops("v5p:4x4x4", True, "fsdp_ep", expert=4)
    assert ("all-gather", full_w) in on, sorted(on)
    # The weight's f32 gradient reduce-scattered in two stages, one per axis: over fsdp (16),
    # which XLA:TPU emits as its fused all-reduce-scatter (shown at its full input), then over
    # expert (4) to the [128, 4096] shard. One collective over both would be one stage.
    grad = {(op, sh) for op, sh in on if "reduce-scatter" in op and sh.endswith(",4096]")}
    assert ("reduce-scatter", "f32[128,4096]") in grad and len(grad) == 2, sorted(on)
    assert not [s for op, s in on if op == "all-reduce"], sorted(on)
