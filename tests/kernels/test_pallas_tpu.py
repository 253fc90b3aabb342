"""pallas_tpu backend in Pallas interpret mode against the float64 oracles.

Legend: M rows, K contraction, N outputs, G groups, L local groups (group_offset windows).

Tolerances are shapes.assert_gmm_close: the f32 summation bound gamma_len * sum|a||b| plus one
rounding to the output dtype (2^-8 relative for bf16, none for f32), computed from float64
oracles on the same rounded inputs. The kernels accumulate in f32 and round once, so a correct
kernel stays inside it; a wrong row, group, mask or tile gives O(1) errors.

Tiles: tm=32 gives several row tiles and group boundaries inside tiles at M <= 300 and is legal
for f32 (8-row) and bf16 (16-row) sublane tiling; tk=tn=128 leave K and N tails on the
TAIL case (K=200, N=136) and equal the full dim on the narrower shared cases.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from shapes import (
    DTYPES,
    GMM_CASES,
    SMALL_CASES,
    GmmCase,
    assert_gmm_close,
    f64,
    make_inputs,
)

from moetext.kernels import gmm as gmm_lib
from moetext.kernels.gmm import GmmCall, gmm_reference, tgmm_reference
from moetext.kernels.gmm.pallas_tpu import PallasTpuBackend
from moetext.kernels.pallas.common import make_group_metadata, max_visits
from moetext.kernels.pallas.tiling import default_tiling

TILES = (32, 128, 128)
# M, K, N all off the tiles: row, contraction and column tails at once; sum(sizes) < M.
TAIL = GmmCase("tails", 300, 200, 136, (0, 70, 5, 100, 0, 60))
BACKEND = "pallas_tpu"  # auto interpret: jax's default backend here is CPU
# Interpret mode lowers each kernel to an XLA while loop; XLA's CPU optimisation passes triple
# its compile time (most of this module's runtime) and buy nothing at these sizes.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
F32_CASES = ("bounds_in_tile", "g128_small_m", "tails")  # bf16 runs every case


def _assert_close(actual, expected, magnitude, length, dtype, what):
    # shapes.assert_gmm_close flags err > tol, which a NaN passes; padding in the
    # interpreters is NaN, so a missing tail mask shows up as NaN and must fail.
    nonfinite = int((~np.isfinite(f64(actual))).sum())
    assert not nonfinite, f"{what}: {nonfinite} non-finite elements"
    assert_gmm_close(actual, expected, magnitude, length, dtype, what)


def _jit_run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _run_gmm(case, dtype, *, backend=BACKEND, transpose_rhs=False, window=None):
    """(out, dlhs, drhs) from gmm and its custom_vjp, plus the inputs; window = (offset, L)."""
    lhs, rhs, dout, gs = make_inputs(case, dtype, transpose_rhs=transpose_rhs)
    offset = None
    if window is not None:
        offset, num_local = window
        rhs = rhs[offset : offset + num_local]

    def run(lhs, rhs, dout, gs):
        f = lambda a, b: gmm_lib.gmm(
            a,
            b,
            gs,
            backend=backend,
            transpose_rhs=transpose_rhs,
            group_offset=offset,
            tiling=TILES,
        )
        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(dout))

    return _jit_run(run, lhs, rhs, dout, gs), (lhs, rhs, dout, gs, offset or 0)


def _check_gmm(case, dtype, **kw):
    results = _run_gmm(case, dtype, **kw)
    (out, dlhs, drhs), (lhs, rhs, dout, gs, offset) = results
    tr = kw.get("transpose_rhs", False)
    a, b, d = f64(lhs), f64(rhs), f64(dout)
    ref = lambda a, b: gmm_reference(a, b, gs, transpose_rhs=tr, group_offset=offset)
    _assert_close(out, ref(a, b), ref(abs(a), abs(b)), case.k, dtype, "gmm")
    # dlhs = dout @ rhs^T per group: a gmm with transpose_rhs flipped, contracting N.
    ref = lambda d, b: gmm_reference(d, b, gs, transpose_rhs=not tr, group_offset=offset)
    _assert_close(dlhs, ref(d, b), ref(abs(d), abs(b)), case.n, dtype, "dlhs")
    # drhs[g] = lhs_g^T @ dout_g ([L, N, K] when transposed); sums run over a group's rows.
    num_local = rhs.shape[0]
    ref = lambda x, y: tgmm_reference(x, y, gs, num_groups=num_local, group_offset=offset)
    x, y = (d, a) if tr else (a, d)
    _assert_close(drhs, ref(x, y), ref(abs(x), abs(y)), max(case.group_sizes), dtype, "drhs")
    return results


def _with_dtypes(cases, f32_names):
    out = [pytest.param(c, jnp.bfloat16, id=f"{c}-bfloat16") for c in cases]
    out += [pytest.param(c, jnp.float32, id=f"{c}-float32") for c in cases if c.name in f32_names]
    return out


@pytest.mark.parametrize("case, dtype", _with_dtypes((*GMM_CASES, TAIL), F32_CASES))
def test_gmm_forward_and_grads(case, dtype):
    _check_gmm(case, dtype)


@pytest.mark.parametrize("case, dtype", _with_dtypes((*SMALL_CASES, TAIL), ("tails",)))
def test_transpose_rhs(case, dtype):
    _check_gmm(case, dtype, transpose_rhs=True)


# Windows: the first group(s), a middle window over empty groups, the last group.
@pytest.mark.parametrize(
    "window, dtype", [((0, 2), jnp.float32), ((1, 3), jnp.bfloat16), ((5, 1), jnp.float32)], ids=str
)
def test_group_offset_window_zeroes_other_rows(window, dtype):
    (out, dlhs, _), (*_, gs, offset) = _check_gmm(TAIL, dtype, window=window)
    # The oracle zeroes non-local rows, but say it outright: those rows must be exactly 0.
    gs = np.asarray(gs)
    ends = np.cumsum(gs)
    lo, hi = ends[offset] - gs[offset], ends[offset + window[1] - 1]
    outside = np.ones(TAIL.m, bool)
    outside[lo:hi] = False
    assert not np.asarray(out)[outside].any() and not np.asarray(dlhs)[outside].any()


# Empty first, middle and last groups; a window (offset 1, L=4) that ends past an empty one.
@pytest.mark.parametrize(
    "offset, num_local, dtype",
    [(None, 6, jnp.bfloat16), (None, 6, jnp.float32), (1, 4, jnp.bfloat16)],
    ids=str,
)
def test_tgmm_empty_groups_and_window(offset, num_local, dtype):
    gs = jnp.asarray([0, 40, 0, 0, 90, 0], jnp.int32)
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((150, 200)), dtype)
    rhs = jnp.asarray(rng.standard_normal((150, 136)), dtype)
    run = lambda lhs, rhs, gs: gmm_lib.tgmm(
        lhs, rhs, gs, num_groups=num_local, backend=BACKEND, group_offset=offset, tiling=TILES
    )
    out = _jit_run(run, lhs, rhs, gs)
    ref = lambda x, y: tgmm_reference(x, y, gs, num_groups=num_local, group_offset=offset or 0)
    a, b = f64(lhs), f64(rhs)
    _assert_close(out, ref(a, b), ref(abs(a), abs(b)), 90, dtype, "tgmm")


# The TPU interpreter also models the DMA of the aliased existing_out blocks.
@pytest.mark.parametrize("interpret", [None, pltpu.InterpretParams()], ids=["auto", "tpu"])
def test_existing_out_keeps_non_local_rows(interpret):
    case = TAIL
    lhs, rhs, _, gs = make_inputs(case, jnp.float32)
    existing = jnp.asarray(np.random.default_rng(1).standard_normal((case.m, case.n)), jnp.float32)
    run = lambda lhs, rhs, gs, existing: PallasTpuBackend(interpret=interpret).gmm(
        lhs, rhs, gs, GmmCall(jnp.float32, jnp.int32(1), TILES), existing_out=existing
    )
    out = _jit_run(run, lhs, rhs[1:4], gs, existing)
    ref = gmm_reference(f64(lhs), f64(rhs[1:4]), gs, group_offset=1)
    mag = gmm_reference(abs(f64(lhs)), abs(f64(rhs[1:4])), gs, group_offset=1)
    ends = np.cumsum(case.group_sizes)
    local = np.zeros(case.m, bool)
    local[ends[0] : ends[3]] = True
    ref[~local] = f64(existing)[~local]
    _assert_close(out, ref, mag, case.k, jnp.float32, "gmm existing_out")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_tpu_faithful_interpreter(dtype):
    # The TPU interpreter models DMAs, output revisits and NaN-filled uninitialised VMEM, so
    # a missed mask, a stale accumulator or an output block written back early shows up here.
    backend = PallasTpuBackend(interpret=pltpu.InterpretParams())
    if dtype == jnp.float32:
        _check_gmm(TAIL, dtype, backend=backend)
    else:
        _check_gmm(TAIL, dtype, backend=backend, transpose_rhs=True, window=(1, 3))


# Groups that cover every row (a dropless dispatch's sorted assignments), off the tiles: with
# rows_covered the kernel has no initial buffer, and the TPU interpreter (NaN for memory never
# written) shows a row tile left unvisited; forward and dlhs against the float64 oracle.
def test_rows_covered_needs_no_initial_buffer():
    case = GmmCase("covered", 300, 200, 136, (0, 70, 5, 125, 0, 100))
    backend = PallasTpuBackend(interpret=pltpu.InterpretParams())
    lhs, rhs, dout, gs = make_inputs(case, jnp.float32)

    def run(lhs, rhs, dout, gs, covered=True):
        f = lambda a, b: gmm_lib.gmm(a, b, gs, backend=backend, tiling=TILES, rows_covered=covered)
        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, vjp(dout)[0])

    out, dlhs = _jit_run(run, lhs, rhs, dout, gs)
    a, b, d = f64(lhs), f64(rhs), f64(dout)
    _assert_close(
        out,
        gmm_reference(a, b, gs),
        gmm_reference(abs(a), abs(b), gs),
        case.k,
        jnp.float32,
        "gmm rows_covered",
    )
    ref = lambda d, b: gmm_reference(d, b, gs, transpose_rhs=True)
    _assert_close(dlhs, ref(d, b), ref(abs(d), abs(b)), case.n, jnp.float32, "dlhs rows_covered")
    # The forward and dlhs gmm calls alias no initial buffer (without rows_covered, both do).
    aliased = lambda covered: str(
        jax.make_jaxpr(functools.partial(run, covered=covered))(lhs, rhs, dout, gs)
    ).count("input_output_aliases=((")
    assert (aliased(True), aliased(False)) == (0, 2)


def test_no_local_rows_gives_zeros():
    lhs, rhs, _, _ = make_inputs(TAIL, jnp.float32)
    gs = jnp.asarray([100, 0, 0, 100, 0, 0], jnp.int32)
    backend = PallasTpuBackend(interpret=pltpu.InterpretParams())
    run = lambda lhs, rhs, gs: gmm_lib.gmm(
        lhs, rhs, gs, backend=backend, group_offset=1, tiling=TILES
    )
    out = _jit_run(run, lhs, rhs[1:3], gs)
    assert out.shape == (TAIL.m, TAIL.n) and not np.asarray(out).any()


# --- tiling --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tiling, dtype, match",
    [
        ((24, 128, 128), jnp.bfloat16, r"\(24, 128, 128\).*tm=24 must be a multiple of 16"),
        ((12, 128, 128), jnp.float32, r"tm=12 must be a multiple of 8 \(float32"),
        ((32, 100, 128), jnp.float32, r"lhs \(300, 200\).*tk=100 must be a multiple of 128"),
        ((32, 128, 64), jnp.float32, r"rhs \(6, 200, 136\).*tn=64 must be a multiple of 128"),
        ((0, 128, 128), jnp.float32, r"three positive ints"),
        ((300, 200, 136, 1), jnp.float32, r"three positive ints"),
    ],
)
def test_tiling_validation(tiling, dtype, match):
    lhs, rhs, _, gs = make_inputs(TAIL, dtype)
    with pytest.raises(ValueError, match=match):
        PallasTpuBackend().gmm(lhs, rhs, gs, GmmCall(dtype, jnp.int32(0), tiling))


def test_tiling_vmem_and_chip_errors():
    lhs, rhs, dout, gs = make_inputs(GMM_CASES[0], jnp.float32)
    big = jax.ShapeDtypeStruct((8192, 8192), jnp.float32)
    call = lambda be, t: jax.eval_shape(
        lambda a, d: be.tgmm(a, d, gs, GmmCall(jnp.float32, jnp.int32(0), t, num_groups=3)),
        big,
        big,
    )
    with pytest.raises(ValueError, match=r"tgmm: tiling .*\(4096, 4096, 4096\).*VMEM.*v5e"):
        call(PallasTpuBackend(chip="v5e"), (4096, 4096, 4096))
    with pytest.raises(ValueError, match=r"unknown TPU chip 'v9'; known chips: tpu7x, v5e"):
        call(PallasTpuBackend(chip="v9"), None)


def test_tiling_callable_and_defaults():
    seen = []

    def lookup(m, k, n, dtype, chip):
        seen.append((m, k, n, jnp.dtype(dtype).name, chip))
        return TILES

    case = SMALL_CASES[0]
    lhs, rhs, _, gs = make_inputs(case, jnp.bfloat16)
    run = lambda lhs, rhs, gs: gmm_lib.gmm(
        lhs, rhs, gs, backend=PallasTpuBackend(chip="v6e"), tiling=lookup
    )
    out = _jit_run(run, lhs, rhs, gs)
    assert seen == [(case.m, case.k, case.n, "bfloat16", "v6e")]
    a, b = f64(lhs), f64(rhs)
    ref = gmm_reference(a, b, gs)
    _assert_close(out, ref, gmm_reference(abs(a), abs(b), gs), case.k, jnp.bfloat16, "gmm")
    # Qwen3-30B-A3B experts (D=2048, F=768, E=128, 65536 rows): tiles divide K and N.
    assert default_tiling(65536, 2048, 768, jnp.bfloat16, "v6e", num_groups=128) == (512, 1024, 768)
    # v5p's two TensorCores split the N tiles, so F=768 is cut in two.
    assert default_tiling(65536, 2048, 768, jnp.bfloat16, "v5p", num_groups=128) == (
        512,
        1024,
        384,
    )
    assert default_tiling(65536, 768, 2048, jnp.bfloat16, "v5e", num_groups=128) == (512, 768, 1024)


# --- metadata ------------------------------------------------------------------------------------


def _visits_loop(sizes, offset, num_local, m, tm, visit_empty):
    """(local group, row tile) visits in order, by brute force over rows."""
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.minimum(np.cumsum(sizes) - np.asarray(sizes), m)
    visits = []
    for j in range(num_local):
        g = offset + j
        lo, hi = (starts[g], ends[g]) if g < len(sizes) else (m, m)
        tiles = sorted({r // tm for r in range(lo, hi)})
        if not tiles and visit_empty:
            tiles = [min(lo // tm, -(-m // tm) - 1)]
        visits += [(j, t) for t in tiles]
    return visits


@pytest.mark.parametrize("visit_empty", [False, True])
@pytest.mark.parametrize(
    "sizes, offset, num_local",
    [
        ((0, 70, 5, 100, 0, 60), 0, 6),
        ((0, 70, 5, 100, 0, 60), 2, 3),
        ((64, 0, 64, 1, 127), 0, 5),
        ((300,), 0, 1),
        ((100, 0, 0, 100, 0, 0), 1, 2),  # no local rows at all
        ((10, 20), 1, 2),  # window running past the last group
    ],
)
def test_group_metadata_matches_brute_force(sizes, offset, num_local, visit_empty):
    m, tm = 300, 32
    meta = make_group_metadata(
        jnp.asarray(sizes, jnp.int32),
        jnp.int32(offset),
        num_local=num_local,
        m=m,
        tm=tm,
        visit_empty=visit_empty,
    )
    want = _visits_loop(sizes, offset, num_local, m, tm, visit_empty)
    num = int(meta.num_visits[0])
    got = list(zip(*(np.asarray(x).tolist() for x in meta[2:4]), strict=True))
    assert len(got) == max_visits(m, tm, num_local) >= num == len(want)
    assert got[:num] == want
    # Steps past the real visits repeat the last one, so no block index changes there.
    assert all(v == got[max(num - 1, 0)] for v in got[num:])
