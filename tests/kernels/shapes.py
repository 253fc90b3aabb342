"""Shared shape table, inputs and tolerances for every grouped-matmul backend's tests.

Legend: M rows, K contraction, N outputs, G groups (len(group_sizes)).

Import from a test module in tests/kernels as `from shapes import GMM_CASES, ...` (pytest puts
this directory on sys.path). Each case is small (dims <= 300) so a backend runs them all fast.

Tolerances (see `assert_gmm_close`): every backend must accumulate in f32 (or better), so with
inputs already rounded to the test dtype the products are exact in f32 and the only errors are
  * summation: |err| <= gamma_L * sum_l |a_l| |b_l|, gamma_L = L u / (1 - L u), u = 2^-24, for
    any summation order over the L terms (the classic dot-product bound), and
  * the final rounding to the output dtype: |err| <= 2^-8 |value| for bf16 (8 significant
    bits, round to nearest), 0 for f32.
The oracle runs in float64 on the same rounded inputs, so a correct backend cannot exceed the
bound, while a wrong row, group or weight gives an O(1) relative error.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

U_F32 = 2.0**-24
OUT_ROUNDING = {jnp.dtype(jnp.float32): 0.0, jnp.dtype(jnp.bfloat16): 2.0**-8}
DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class GmmCase:
    name: str
    m: int
    k: int
    n: int
    group_sizes: tuple[int, ...]

    @property
    def g(self) -> int:
        return len(self.group_sizes)

    def __str__(self) -> str:
        return self.name


def _g128_sizes() -> tuple[int, ...]:
    # 128 groups over 160 rows: mostly 0/1/2-row groups, a few larger, sum 150 < M.
    rng = np.random.default_rng(128)
    sizes = rng.multinomial(140, rng.dirichlet(np.full(128, 0.3)))
    sizes[[0, 63, 127]] = [4, 6, 0]  # pin a non-empty first, a mid, and an empty last group
    return tuple(int(s) for s in sizes)


GMM_CASES = (
    GmmCase("m_not_128", 200, 128, 128, (50, 70, 80)),
    GmmCase("k_not_128", 128, 72, 128, (64, 64)),
    GmmCase("n_not_128", 128, 128, 40, (32, 96)),
    GmmCase("empty_first", 136, 64, 48, (0, 60, 76)),
    GmmCase("empty_middle", 136, 64, 48, (60, 0, 0, 76)),
    GmmCase("empty_last", 136, 64, 48, (60, 76, 0)),
    GmmCase("all_in_one", 130, 96, 72, (0, 130, 0, 0)),
    GmmCase("bounds_in_tile", 256, 64, 64, (3, 1, 17, 100, 5, 130)),
    GmmCase("tail_past_m", 200, 40, 24, (5, 195)),
    GmmCase("sum_below_m", 300, 80, 56, (40, 0, 90, 20)),
    GmmCase("g1", 96, 48, 80, (96,)),
    GmmCase("g128_small_m", 160, 32, 24, _g128_sizes()),
)
# A short subset with empty groups, a partial sum, odd K/N and G=1 (used by the Pallas tests).
SMALL_CASES = tuple(c for c in GMM_CASES if c.name in ("empty_middle", "sum_below_m", "g1"))
# The case for the option tests (transpose_rhs, group_offset windows, existing_out, tgmm): it
# has an empty group, rows past sum(group_sizes) and K, N off 128. One case, because every
# compile of a loop-based backend costs seconds on a small CPU.
OPTION_CASES = tuple(c for c in GMM_CASES if c.name == "sum_below_m")


def make_inputs(case: GmmCase, dtype, seed: int = 0, *, transpose_rhs: bool = False):
    """lhs [M, K], rhs [G, K, N] ([G, N, K]), dout [M, N] in dtype, group_sizes int32 [G]."""
    rng = np.random.default_rng(seed)
    rhs_shape = (case.g, case.n, case.k) if transpose_rhs else (case.g, case.k, case.n)
    lhs = jnp.asarray(rng.standard_normal((case.m, case.k)), dtype)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape), dtype)
    dout = jnp.asarray(rng.standard_normal((case.m, case.n)), dtype)
    return lhs, rhs, dout, jnp.asarray(case.group_sizes, jnp.int32)


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def assert_gmm_close(actual, expected, magnitude, length: int, dtype, what: str) -> None:
    """|actual - expected| <= gamma_length * magnitude + out_rounding(dtype) * |expected|.

    expected: float64 oracle on the rounded inputs; magnitude: the same oracle on |inputs|
    (sum of |products| per element); length: the longest sum (K, or rows per group for tgmm).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert jnp.dtype(actual.dtype) == jnp.dtype(dtype), f"{what}: dtype {actual.dtype} != {dtype}"
    gamma = length * U_F32 / (1 - length * U_F32)
    r = OUT_ROUNDING[jnp.dtype(dtype)]
    # The output rounding acts on the computed sum, hence the (1 + r) on the summation term.
    tol = gamma * (1 + r) * magnitude + r * np.abs(expected)
    err = np.abs(f64(actual) - expected)
    bad = ~(err <= tol)  # NaN fails too: NaN > tol is False
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.size} elements off; first at {idx}: "
            f"got {f64(actual)[idx]}, want {expected[idx]} (tol {tol[idx]:.3g}); "
            f"max err {err.max():.3g}"
        )
