"""The helpers the Pallas kernels share (kernels/pallas/common.py, pallas/tiling.py) against
independent oracles: exact integer arithmetic, a row-by-row coverage check of the visit schedule,
and the generic interpreter for the TPU interpreter's aliased output.

Legend: M rows, G groups, L local groups, tm rows per tile, T visit steps.
"""

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from moetext.kernels.pallas import gmm_fp8, tiling
from moetext.kernels.pallas.common import (
    cdiv,
    make_group_metadata,
    max_visits,
    pow2_ceil,
    resolve_interpret,
    round_up,
)
from moetext.kernels.quant import quantize

# --- tile arithmetic -----------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0, 1, 7, 8, 9, 127, 128, 129, 65536, 65537])
@pytest.mark.parametrize("b", [1, 8, 128, 1000])
def test_cdiv_and_round_up_match_exact_ceiling(a, b):
    want = math.ceil(fractions.Fraction(a, b))
    assert cdiv(a, b) == want
    assert round_up(a, b) == want * b and round_up(a, b) - a in range(b)


@pytest.mark.parametrize("x", [-3, 0, 1, 2, 3, 4, 5, 127, 128, 129, 1000])
def test_pow2_ceil_is_smallest_power_of_two_at_least_x(x):
    want = next(p for p in (2**e for e in range(20)) if p >= x)
    assert pow2_ceil(x) == want


# --- visit schedule ------------------------------------------------------------------------------


def _check_schedule(sizes, offset, num_local, m, tm, visit_empty):
    """Checks the schedule by what it must do, row by row, not by how it is computed."""
    meta = make_group_metadata(
        jnp.asarray(sizes, jnp.int32),
        jnp.int32(offset),
        num_local=num_local,
        m=m,
        tm=tm,
        visit_empty=visit_empty,
    )
    starts, ends, gids, tiles, num = (np.asarray(x) for x in meta)
    num = int(num[0])
    # Local group j owns global group offset + j's rows, clipped to [0, M); past G it is empty.
    bounds = []
    row = 0
    for size in sizes:
        bounds.append((min(row, m), min(row + size, m)))
        row += size
    want = [bounds[offset + j] if offset + j < len(sizes) else (m, m) for j in range(num_local)]
    assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == want

    assert len(gids) == len(tiles) == max_visits(m, tm, num_local) >= num
    visits = list(zip(gids[:num].tolist(), tiles[:num].tolist(), strict=True))
    # Each local row is covered by exactly one visit, and every visit covers rows of its group
    # (or is the one visit of an empty group, when asked for).
    covered = {}
    for g, t in visits:
        assert 0 <= g < num_local and 0 <= t < cdiv(m, tm)
        lo, hi = want[g]
        rows = range(max(lo, t * tm), min(hi, (t + 1) * tm))
        if lo == hi:
            assert visit_empty and visits.count((g, t)) == 1
        else:
            assert len(rows) > 0, f"visit {(g, t)} covers none of group {g}'s rows [{lo}, {hi})"
        for r in rows:
            assert (g, r) not in covered
            covered[g, r] = True
    assert set(covered) == {(g, r) for g, (lo, hi) in enumerate(want) for r in range(lo, hi)}
    empty = [g for g, (lo, hi) in enumerate(want) if lo == hi]
    assert [g for g, _ in visits if g in empty] == (empty if visit_empty else [])
    # Row tiles in row order, groups in order, so revisits of a tile are consecutive.
    assert visits == sorted(visits, key=lambda v: (v[1], v[0]))
    assert visits == sorted(visits)
    # Steps past the real visits repeat the last one (no block index change, no DMA).
    last = (int(gids[max(num - 1, 0)]), int(tiles[max(num - 1, 0)]))
    assert all((int(g), int(t)) == last for g, t in zip(gids[num:], tiles[num:], strict=True))


SCHEDULES = [
    # sizes, offset, num_local, M, tm
    ((0, 0, 0), 0, 3, 64, 16),  # no rows at all
    ((1,), 0, 1, 1, 8),  # one row, tile larger than M
    ((5, 0, 3), 0, 3, 8, 8),  # all groups in one tile
    ((16, 16, 16, 16), 0, 4, 64, 16),  # groups on tile boundaries
    ((17, 15, 1, 31), 0, 4, 64, 16),  # groups straddling boundaries
    ((10, 20, 30, 40), 2, 2, 100, 32),  # expert-parallel window
    ((10, 20, 30), 2, 3, 60, 32),  # window running past the last group
    ((50, 50, 50), 0, 3, 100, 32),  # sum(group_sizes) > M: clipped
    ((10, 20), 0, 2, 100, 32),  # rows past sum(group_sizes) belong to no group
    ((16, 16, 0), 0, 3, 32, 16),  # empty last group starting at M = whole tiles
    ((32, 40), 0, 2, 32, 16),  # a group clipped away entirely, at M = whole tiles
]


@pytest.mark.parametrize("visit_empty", [False, True])
@pytest.mark.parametrize("sizes, offset, num_local, m, tm", SCHEDULES)
def test_group_metadata_covers_each_local_row_once(sizes, offset, num_local, m, tm, visit_empty):
    _check_schedule(sizes, offset, num_local, m, tm, visit_empty)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_metadata_large_random(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 200, 64) * (rng.random(64) < 0.7)  # ~30% empty experts
    m = int(sizes.sum())
    _check_schedule(sizes.tolist(), 16, 32, m, 128, visit_empty=True)


def test_group_metadata_traces_under_jit():
    sizes, offset = jnp.asarray([3, 0, 9, 4], jnp.int32), jnp.int32(1)
    run = jax.jit(lambda s, o: make_group_metadata(s, o, num_local=3, m=16, tm=8, visit_empty=True))
    for got, want in zip(
        run(sizes, offset),
        make_group_metadata(sizes, offset, num_local=3, m=16, tm=8, visit_empty=True),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


# --- tile validation, chip and interpret resolution ---------------------------------------------


@pytest.mark.parametrize(
    "tiles, dtype, ok",
    [
        ((16, 128, 128), jnp.bfloat16, True),
        ((24, 128, 128), jnp.bfloat16, False),  # bf16 packs 16 rows per sublane tile
        ((8, 128, 128), jnp.float32, True),
        ((32, 128, 128), jnp.float8_e4m3fn, True),
        ((16, 128, 128), jnp.float8_e4m3fn, False),  # 8-bit packs 32 rows
        ((16, 100, 128), jnp.float32, False),  # tk neither a multiple of 128 nor K
        ((16, 200, 128), jnp.float32, True),  # tk equal to the full K is always legal
    ],
)
def test_gmm_block_rule(tiles, dtype, ok):
    lhs = jax.ShapeDtypeStruct((64, 200), dtype)
    rhs = jax.ShapeDtypeStruct((2, 200, 256), dtype)
    check = lambda: tiling.check_gmm_blocks("gmm", tiles, lhs, rhs, dtype, transpose_rhs=False)
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match=r"gmm: tiling \(tm, tk, tn\)=.* breaks the TPU"):
            check()


def test_tgmm_block_rule_names_the_array():
    lhs = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    rhs = jax.ShapeDtypeStruct((64, 200), jnp.float32)
    with pytest.raises(ValueError, match=r"rhs \(64, 200\) float32: tn=64 must be a multiple"):
        tiling.check_tgmm_blocks("tgmm", (8, 128, 64), lhs, rhs, jnp.float32)


@pytest.mark.parametrize("bad", [(0, 128, 128), (128, 128), (None, 128, 128), 5, "abc"])
def test_resolve_tiling_rejects_malformed(bad):
    with pytest.raises(ValueError, match="tiling must be three positive ints"):
        tiling.resolve_tiling(bad, 256, 256, 256, jnp.bfloat16, "v5p", num_groups=2)


def test_resolve_tiling_clamps_to_dims():
    assert tiling.resolve_tiling(
        (512, 512, 512), 100, 256, 64, jnp.bfloat16, "v5p", num_groups=1
    ) == (
        100,
        256,
        64,
    )


def test_resolve_chip_and_interpret_off_tpu():
    assert jax.default_backend() != "tpu"  # the test session runs on CPU (conftest)
    assert tiling.resolve_chip(None) == tiling.FALLBACK_CHIP
    assert tiling.resolve_chip("v6e") == "v6e"
    with pytest.raises(ValueError, match="known chips: tpu7x, v5e, v5p, v6e"):
        tiling.resolve_chip("v4")
    assert resolve_interpret(None) is True
    params = pltpu.InterpretParams()
    assert resolve_interpret(False) is False and resolve_interpret(params) is params


# --- aliased output under the TPU interpreter ----------------------------------------------------


def test_gmm_fp8_tpu_interpreter_ragged_m():
    # The TPU interpreter returns the aliased output padded to whole blocks; gmm_fp8 shares the
    # bf16 kernel's handling of that, so M = 200 with tm = 128 runs and matches the generic
    # interpreter bit for bit (it once failed to lower: the padded output's shape mismatched).
    rng = np.random.default_rng(0)
    lq, ls = quantize(jnp.asarray(rng.standard_normal((200, 128)), jnp.float32), axis=1)
    rq, rs = quantize(jnp.asarray(rng.standard_normal((3, 128, 128)), jnp.float32), axis=1)
    gs = jnp.asarray([50, 0, 120], jnp.int32)
    run = lambda interpret: gmm_fp8(
        lq, ls, rq, rs, gs, tiling=(128, 128, 128), interpret=interpret,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    got, want = run(pltpu.InterpretParams()), run(True)
    assert got.shape == (200, 128)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.asarray(got[170:]).any()  # rows past sum(group_sizes) stay zero
