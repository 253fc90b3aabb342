"""Sharded expert weights in gmm (kernels/gmm/gather.py): the weight gradient reduce-scattered a
tile at a time equals the one-piece reduction and the unsharded gradient; gathering the weights
again in the backward (regather_weights) changes nothing, nor does gathering a slice with its
minor dims swapped (minor_swapped); the tile plan; the narrowing cast that XLA must not hoist
out of a layer scan.

The 8-device part runs in a fresh interpreter (gather_worker.py, 8 fake CPU devices).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fake_devices import run_worker_once
from moetext.kernels.gmm import GmmCall, WeightGather, gather


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_worker_once(tmp_path_factory, "tests.kernels.gather_worker", timeout_s=900)


def test_tiled_reduce_scatter_runs_in_several_tiles(result):
    # K over b: N = 48 is not gathered, 6 tiles of 8; both dims gathered: the gathered dim with
    # more columns per shard in tiles of 8 columns per shard's block.
    assert result["tiles"] == {
        "K_over_b": 6,
        "N_over_b": 8,
        "K_over_ab": 6,
        "K_over_a_N_over_b": 8,
        "transposed_N_over_b": 8,
    }


# A tile of the weight gradient is a dot of another shape than the whole (8 columns vs 48), and
# XLA:CPU picks a dot's blocking from the operand shapes and the host's vector width (AVX2,
# AVX-512): the same float32 products may be summed in another order (ragged_dot: bitwise on an
# AVX-512 host, 1.31e-7 of the largest entry on an AVX2 one, 2026-11-27). So the tiled gradient
# is held to a bound, not equality. Per shard, a sum of at most M = 40 rows in two orders
# differs by <= 2 * M * 2^-24 of its sum of |products| (unit roundoff 2^-24); the shards'
# partials are summed in the same order either way (+ SHARDS roundings' worth for the
# propagation). With grad_reduce_dtype=bfloat16 each partial, and each of the reduction's
# SHARDS - 1 partial sums, may then round one bf16 ulp apart (<= 2^-7 of each, all <= the sum
# of |products|): SHARDS * 2^-7.
# Relative to the largest entry: times drhs_abs_scale (gather_worker). A tile in the wrong place
# would be off by the entries themselves (relative difference ~1). Measured (AVX2, 2026-11-27):
# drhs_abs_scale 1.50-1.63, so bounds 9.3e-6 (float32) and 0.10 (bf16) against differences of
# <= 1.35e-7 (ragged_dot, float32) and 0 (every other key).
ROWS, SHARDS = 40, 8
F32_REORDERED = 2 * (ROWS + SHARDS) * 2.0**-24
BF16_REDUCED = F32_REORDERED + SHARDS * 2.0**-7


def test_tiled_weight_gradient_is_the_one_piece_reduction(result):
    # The forward and dlhs run the same ops on the same shapes either way: bitwise. The weight
    # gradient's tiles are the one-piece reduction's columns, up to the order of their sums.
    for key, (loss, dlhs, drhs) in result["tiled_vs_whole"].items():
        assert loss == dlhs == 0.0, (key, loss, dlhs)
        per_scale = BF16_REDUCED if key.endswith("/bfloat16") else F32_REORDERED
        bound = per_scale * result["drhs_abs_scale"][key]
        assert drhs <= bound, (key, drhs, bound)


def test_regathering_in_the_backward_is_bitwise_keeping_the_forward_copy(result):
    # regather_weights gathers the same slice into the same values and runs the same backward
    # math on them: identical loss, dlhs and drhs for every layout, backend and reduce dtype.
    assert len(result["regather_vs_whole"]) == 20
    # ... and it does gather again: one all-gather in the forward, a second in the backward.
    assert result["all_gathers"] == {"False": 1, "True": 2}, result["all_gathers"]
    for key, diffs in result["regather_vs_whole"].items():
        assert diffs == [0.0, 0.0, 0.0], (key, diffs)


def test_gathering_both_axes_in_one_collective_is_bitwise_the_per_axis_gather(result):
    # gather_jointly: one all-gather over (a, b) where there were two; an all-gather only moves
    # data, and the blocks land in the same order, so every number is the same.
    assert result["all_gathers_jointly"] == {"False": 2, "True": 1}, result
    for backend, diffs in result["jointly_vs_per_axis"].items():
        assert diffs == [0.0, 0.0, 0.0], (backend, diffs)


def test_tiled_weight_gradient_equals_the_unsharded_gradient(result):
    # Against each shard's rows times the whole weight, no collectives: the forward and dlhs
    # are identical; the weight gradient sums 8 shards' partial gradients in another order
    # (measured <= 1.9e-7 of the largest entry in f32), or in bf16 under
    # grad_reduce_dtype=bfloat16 (a few bf16 roundings, 2^-8 each: measured <= 5.4e-3).
    for key, (loss, gx, gw) in result["tiled_vs_unsharded"].items():
        assert loss == 0.0 and gx == 0.0, (key, loss, gx)
        bound = 2**-6 if key.endswith("bfloat16") else 1e-6
        assert gw <= bound, (key, gw)


@pytest.mark.parametrize(
    ("shape", "shards", "itemsize", "plan"),
    [
        # Qwen3-30B-A3B experts on 32 chips: w_gate [E, D/32 gathered, F], w_down [E, F, D/32].
        ((128, 2048, 768), {1: 32}, 4, (2, 3)),  # 768 MiB f32 -> 3 x 256 MiB
        ((128, 768, 2048), {2: 32}, 4, (1, 3)),
        # bf16 reduction: 384 MiB, one piece (GRAD_TILE_BYTES_16BIT)
        ((128, 2048, 768), {1: 32}, 2, (2, 1)),
        # Qwen3-235B-A22B: 3 GiB; 256-column tiles at the least, so 6 of 512 MiB; 1.5 GiB in
        # bf16 (GRAD_TILE_BYTES_16BIT): one piece, and so is gate|up fused (3 GiB).
        ((128, 4096, 1536), {1: 128}, 4, (2, 6)),
        ((128, 4096, 1536), {1: 128}, 2, (2, 1)),
        ((128, 4096, 3072), {1: 128}, 2, (2, 1)),
        # DeepSeek-V3 [256, 7168, 2048] bf16 (7 GiB): 4 tiles of 1.75 GiB (3 tiles do not
        # divide the 2048 columns).
        ((256, 7168, 2048), {1: 512}, 2, (2, 4)),
        # Both dims gathered (fsdp_tp): the one with more columns per shard.
        ((128, 2048, 768), {1: 32, 2: 4}, 4, (2, 3)),
        ((128, 2048, 768), {1: 4, 2: 2}, 4, (1, 4)),
        ((8, 64, 64), {1: 8}, 4, (2, 1)),  # small: one piece
    ],
)
def test_grad_tiles(shape, shards, itemsize, plan):
    assert gather.grad_tiles(shape, shards, itemsize) == plan


def test_narrow_rounds_like_the_cast_and_keeps_a_reduce_precision():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    edge = np.array(
        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.39e38, 3.4e38, np.inf, -np.inf, 1e-40, np.nan],
        np.float32,
    )
    for dtype in (jnp.bfloat16, jnp.float16):
        for v in (x, edge, x * 1e4):
            got = np.asarray(gather.narrow(jnp.asarray(v), dtype)).astype(np.float64)
            want = np.asarray(jnp.asarray(v).astype(dtype)).astype(np.float64)
            np.testing.assert_array_equal(got, want)
    jaxpr = str(jax.make_jaxpr(lambda w: gather.narrow(w, jnp.bfloat16))(jnp.zeros(4)))
    assert re.search(r"reduce_precision\[.*exponent_bits=8.*mantissa_bits=7", jaxpr), jaxpr
    # Widening, same-width and integer casts are plain casts.
    for src, dst in (
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32),
        (jnp.int32, jnp.int16),
    ):
        jaxpr = str(jax.make_jaxpr(lambda w, d=dst: gather.narrow(w, d))(jnp.zeros(4, src)))
        assert "reduce_precision" not in jaxpr, (src, dst)


@pytest.mark.parametrize("quantization", ["fp8_blockwise", "fp8_tensorwise"])
def test_recipes_without_a_regather_refuse_it(quantization):
    from moetext.kernels import build_gmm

    op = build_gmm("blocked", quantization, regather_weights=True)
    x, w = jnp.zeros((8, 16)), jnp.zeros((2, 16, 4))
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(
        ValueError, match=f"regather_weights is not implemented by the '{quantization}'"
    ):
        op.recipe.gathered_gmm(
            op.backend,
            x,
            w,
            sizes,
            GmmCall(jnp.float32, jnp.zeros((), jnp.int32)),
            WeightGather(((1, ("fsdp",)),), None, regather=True),
        )


# gather.minor_swapped: a slice split along N with a narrow local N is gathered as [G, N, K] and
# multiplied with transpose_rhs flipped. The same products are summed, but by another program:
# the dots see a transposed operand, so XLA:CPU may block (and order) their sums otherwise,
# and the gradient's reduce-scatter is planned on the other shape. Not provably the same
# arithmetic, so held to a bound. With gamma(n) = n u / (1 - n u), u = 2^-24, two orders of
# an n-term float32 sum differ by at most 2 gamma(n) times its sum of |terms| (Higham), and
# A[r, n] = sum_k |x w| bounds out[r, n]'s terms:
#   out:  K = 64 terms, |d out| <= 2 gamma(K) A; dout = 2 out (exact) moves by 4 gamma(K) A.
#   loss: sum(out^2) moves by <= sum 2 |out| |d out| = 4 gamma(K) sum |out| A, plus its own
#         sum of M*N squares per shard and S shards in another order, 2 gamma(M*N + S) of the
#         loss (the terms are >= 0). Second-order terms (gamma^2) are below 1e-10 of these.
#   dlhs: dlhs[r, k] = sum_n dout w over N = 48: <= 4 gamma(K) sum_n A |w| (dout moved) +
#         2 gamma(N) sum_n |dout w| (reordered).
#   drhs: a group's rows, M per shard, then S shards: <= 4 gamma(K) sum_r |x| A +
#         2 gamma(M + S) sum_r |x dout|. With grad_reduce_dtype=bfloat16 each of the S partials
#         and the S - 1 partial sums may round one bf16 ulp apart (<= 2^-7 of a value <= the
#         sum of |products|): + S 2^-7 sum_r |x dout|, as for the tiles above.
# Relative to the largest entry: times swap_scales (gather_worker: those magnitude sums over
# the largest entry, from the data; here loss 4.2, dlhs 3.8 / 1.4, drhs 4.5 / 1.5 for A / dout),
# so bounds of 2.9e-4 (loss), 6.6e-5 (dlhs), 7.7e-5 (drhs, float32), 0.095 (drhs, bf16 reduce).
# Measured: 0 for every key (this test asserted bitwise equality until 2026-11-27 and held on
# the hosts seen). Gathering the wrong dim, or multiplying by the un-transposed slice, is off
# by the entries themselves (relative difference ~1).
K, N, U = 64, 48, 2.0**-24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def test_swapping_the_slices_minor_dims_changes_no_number_beyond_rounding(result):
    assert len(result["swapped_vs_not"]) == 4
    for key, (loss, dlhs, drhs) in result["swapped_vs_not"].items():
        scale = result["swap_scales"][key]
        reduced = 2 * _gamma(ROWS + SHARDS)
        if key.endswith("/bfloat16"):
            reduced += SHARDS * 2.0**-7
        bounds = (
            4 * _gamma(K) * scale["loss"] + 2 * _gamma(ROWS * N + SHARDS),
            4 * _gamma(K) * scale["dlhs_A"] + 2 * _gamma(N) * scale["dlhs_dout"],
            4 * _gamma(K) * scale["drhs_A"] + reduced * scale["drhs_dout"],
        )
        for name, diff, bound in zip(
            ("loss", "dlhs", "drhs"), (loss, dlhs, drhs), bounds, strict=True
        ):
            assert diff <= bound, (key, name, diff, bound)


@pytest.mark.parametrize(
    ("shape", "gather_dims", "swapped"),
    [
        # Qwen3-30B-A3B w_down [128, 768, 2048] on fsdp = 32: local N = 64 < 128 lanes.
        ((128, 768, 64), ((2, ("fsdp",)),), ((1, ("fsdp",)),)),
        ((2, 8, 12), ((0, ("expert",)), (2, ("a", "b"))), ((0, ("expert",)), (1, ("a", "b")))),
        # fsdp = 8 leaves 256 columns: stored row-major, swapping would transpose; not done.
        ((128, 768, 256), ((2, ("fsdp",)),), None),
        ((128, 64, 768), ((1, ("fsdp",)),), None),  # w_gate: K gathered, already [G, K, N]
        ((128, 24, 64), ((1, ("a",)), (2, ("b",))), None),  # both gathered
        ((128, 768, 64), (), None),
        ((4, 8, 127), ((2, ("b",)),), ((1, ("b",)),)),  # the boundary: under 128 lanes
        ((4, 8, 128), ((2, ("b",)),), None),
    ],
)
def test_minor_swapped(shape, gather_dims, swapped):
    assert gather.minor_swapped(shape, gather_dims) == swapped
