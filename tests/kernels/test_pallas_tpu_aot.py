"""pallas_tpu kernels lower and compile with Mosaic for real TPU targets, ahead of time.

Legend: M rows (tokens * top-k), D model dim, F expert hidden dim, E experts.

No TPU needed: libtpu compiles against a topology description. Each test compiles one of the
three calls a gmm layer makes (forward; dlhs = gmm with transpose_rhs flipped; drhs = tgmm) at
the default tiling for one TPU generation and one model's expert shapes. The last test compiles
a gathered expert weight's gradient on a 32-chip slice and reads the HLO for weight relayouts.
"""

import contextlib
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from moetext.aot import TOPOLOGY_BY_CHIP, tpu_devices
from moetext.kernels.gmm import Gmm, GmmCall
from moetext.kernels.gmm import api as gmm_api
from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend

pytestmark = pytest.mark.tpu_aot

M = 8192 * 8  # 8192 tokens routed to top-8 experts
MODELS = {"qwen3-30b-a3b": (2048, 768, 128), "qwen3-235b-a22b": (4096, 1536, 128)}  # D, F, E


@functools.cache
def _device(chip: str):
    return tpu_devices(TOPOLOGY_BY_CHIP[chip])[0]


def _calls(backend: PallasTpuBackend, d: int, f: int, e: int):
    """{call: (fn, arg shapes)} for the gate/up projection x[M, D] @ w[E, D, F]."""
    bf16 = jnp.bfloat16
    common = GmmCall(bf16, jnp.int32(0))
    fwd = lambda x, w, gs: backend.gmm(x, w, gs, common)
    dlhs = lambda dy, w, gs: backend.gmm(dy, w, gs, common.replace(transpose_rhs=True))
    drhs = lambda x, dy, gs: backend.tgmm(x, dy, gs, common.replace(num_groups=e))
    x, w, dy, gs = (M, d), (e, d, f), (M, f), (e,)
    return {
        "fwd": (fwd, ((x, bf16), (w, bf16), (gs, jnp.int32))),
        "dlhs": (dlhs, ((dy, bf16), (w, bf16), (gs, jnp.int32))),
        "drhs": (drhs, ((x, bf16), (dy, bf16), (gs, jnp.int32))),
    }


@pytest.mark.parametrize("call", ["fwd", "dlhs", "drhs"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("chip", list(TOPOLOGY_BY_CHIP))
def test_compiles_for_tpu(chip, model, call):
    device = _device(chip)
    backend = PallasTpuBackend(interpret=False, chip=chip)
    fn, shapes = _calls(backend, *MODELS[model])[call]
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, dt, sharding=sharding) for s, dt in shapes]
    compiled = jax.jit(fn).lower(*args).compile()
    # The Mosaic kernel itself, not an interpreted loop, must be in the TPU executable.
    assert "tpu_custom_call" in compiled.as_text()
    out = compiled.out_info
    d, f, e = MODELS[model]
    want = {"fwd": (M, f), "dlhs": (M, d), "drhs": (e, d, f)}[call]
    assert out.shape == want and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("chip", list(TOPOLOGY_BY_CHIP))
def test_for_device_targets_the_topology(chip):
    assert PallasTpuBackend.for_device(_device(chip)) == PallasTpuBackend(
        interpret=False, chip=chip
    )


# Off-tile M, K and N put the K-tail masks, partial edge blocks and (with existing_out) the
# blocked initial-buffer path through Mosaic; the model shapes above divide evenly.
TAIL_M, TAIL_K, TAIL_N, TAIL_G = 1000, 320, 200, 8


def _tail_calls(backend: PallasTpuBackend):
    bf16, i32 = jnp.bfloat16, jnp.int32
    kw = GmmCall(bf16, jnp.int32(0), (128, 128, 128))
    m, k, n, g = TAIL_M, TAIL_K, TAIL_N, TAIL_G
    return {
        "fwd": (
            lambda x, w, gs: backend.gmm(x, w, gs, kw),
            (((m, k), bf16), ((g, k, n), bf16), ((g,), i32)),
        ),
        "transpose_rhs": (
            lambda x, w, gs: backend.gmm(x, w, gs, kw.replace(transpose_rhs=True)),
            (((m, k), bf16), ((g, n, k), bf16), ((g,), i32)),
        ),
        "existing_out": (
            lambda x, w, gs, e: backend.gmm(x, w, gs, kw, existing_out=e),
            (((m, k), bf16), ((g, k, n), bf16), ((g,), i32), ((m, n), bf16)),
        ),
        "tgmm": (
            lambda x, d, gs: backend.tgmm(x, d, gs, kw.replace(num_groups=g)),
            (((m, k), bf16), ((m, n), bf16), ((g,), i32)),
        ),
    }


@pytest.mark.parametrize("call", ["fwd", "transpose_rhs", "existing_out", "tgmm"])
@pytest.mark.parametrize("chip", ["v5e", "tpu7x"])
def test_compiles_with_tails(chip, call):
    device = _device(chip)
    fn, shapes = _tail_calls(PallasTpuBackend(interpret=False, chip=chip))[call]
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, dt, sharding=sharding) for s, dt in shapes]
    compiled = jax.jit(fn).lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    want = (TAIL_G, TAIL_K, TAIL_N) if call == "tgmm" else (TAIL_M, TAIL_N)
    assert compiled.out_info.shape == want


GATHER_D = ((2, ("fsdp",)),)  # w_down [E, F, D]: this chip's slice of D


def _gathered_w_down_grad(swap: bool) -> jax.stages.Compiled:
    """The weight gradient of two scanned layers multiplying by Qwen3-30B-A3B's w_down
    [E, F, D] f32, fsdp-sharded along D over 32 chips (v5p:4x4x2) and all-gathered per layer in
    bf16 (gmm's rhs_gather), compiled; swap=False gathers the slice as given, not swapped."""
    d, f, e = MODELS["qwen3-30b-a3b"]
    devices = tpu_devices("v5p:4x4x2")
    mesh = Mesh(np.array(devices), ("fsdp",))
    op = Gmm(PallasTpuBackend(interpret=False, chip="v5p"))
    w_spec = P(None, None, None, "fsdp")

    def body(w: jax.Array, h: jax.Array, sizes: jax.Array) -> jax.Array:
        def layer(h: jax.Array, w_l: jax.Array) -> tuple[jax.Array, None]:
            y = op(h, w_l, sizes, preferred_element_type=jnp.bfloat16, rhs_gather=GATHER_D)
            return h + y[:, :f], None

        out, _ = jax.lax.scan(layer, h, w)
        return jax.lax.psum(jnp.sum(out.astype(jnp.float32)), "fsdp")

    loss = jax.shard_map(
        body, mesh=mesh, in_specs=(w_spec, P("fsdp"), P()), out_specs=P(), check_vma=False
    )
    spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, p)
    )
    args = (
        spec((2, e, f, d), jnp.float32, w_spec),
        spec((4096 * len(devices), f), jnp.bfloat16, P("fsdp")),  # 4096 rows per chip
        spec((e,), jnp.int32, P()),
    )
    with contextlib.ExitStack() as stack:
        if not swap:
            stack.enter_context(mock.patch.object(gmm_api, "minor_swapped", lambda *a: None))
        return jax.jit(jax.grad(loss)).lower(*args).compile()


def _weight_copies(hlo: str) -> list[str]:
    """Result shapes of the HLO's relayouts (copy, copy-start, transpose) of expert-weight-sized
    arrays: a [128 experts, ...] array of rank >= 3 with a 768 (F), 2048 (D) or 64 (D / 32) dim.
    A copy-start's result is a tuple whose first element is the destination."""
    op = r"(?:copy|copy-start|transpose)\("
    shapes = re.findall(r"= \(?((?:f32|bf16)\[([0-9,]+)\]\{[^}]*\})[^=]*? " + op, hlo)
    dims = [(s, [int(x) for x in d.split(",")]) for s, d in shapes]
    return [s for s, d in dims if len(d) >= 3 and 128 in d and {768, 2048, 64} & set(d)]


def test_gathering_w_down_narrow_slices_swapped_copies_no_weight():
    # fsdp = 32 leaves w_down [128, 768, 64] per chip, which XLA:TPU stores with the narrow
    # dim second-minor; gathered along it as given, XLA copies the slice to a new layout before
    # the all-gather and the gathered [128, 768, 2048] weight again before the Mosaic kernel
    # (the whole-model step hoists the first copy out of the layer scan: 1.12 GiB per chip,
    # docs/performance.md). Gathered swapped (gather.minor_swapped) nothing is copied.
    swapped, given = _gathered_w_down_grad(True), _gathered_w_down_grad(False)
    assert _weight_copies(swapped.as_text()) == []
    # The control: what XLA does with the slice as given is still to relayout the local f32
    # slice (to {2,1,0,3} with libtpu 0.0.50.1) and the gathered bf16 weight.
    copies = _weight_copies(given.as_text())
    assert any(c.startswith("f32[1,128,768,64]") for c in copies), copies
    assert any(c.startswith("bf16[1,128,768,2048]") for c in copies), copies
    # Measured 1620 against 2356 MiB of temporaries (libtpu 0.0.50.1): at least the gathered
    # bf16 weight's copy (384 MiB) less.
    temp = [c.memory_analysis().temp_size_in_bytes for c in (swapped, given)]
    assert temp[0] <= temp[1] - 384 * 2**20, temp
