"""The fused MoE decode kernel (kernels/pallas/moe_decode.py) against a float64 NumPy oracle.

Legend: T decode rows, K experts per token, E experts, D emb_dim, F expert hidden dim.

Off TPU the kernel runs in Pallas interpret mode; the last tests compile it with Mosaic for TPU
topologies ahead of time (libtpu, no TPU needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import SingleDeviceSharding

from moetext.aot import TOPOLOGY_BY_CHIP, tpu_devices
from moetext.hlo_cost import hlo_cost
from moetext.kernels.pallas import moe_decode as md
from moetext.kernels.pallas import moe_decode_split as mds
from moetext.kernels.pallas import target


def oracle(x, ids, w, w_gate_up, w_down):
    """y_TD = sum_k w[t, k] * down_e(silu(x_t @ gate_e) * (x_t @ up_e)), float64, per pair."""
    x, w_gate_up, w_down = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down))
    f = w_down.shape[1]
    y = np.zeros(x.shape)
    for t, k in np.ndindex(*ids.shape):
        e = int(ids[t, k])
        if not 0 <= e < w_down.shape[0]:
            continue  # an id outside [0, E) selects nothing
        gu = x[t] @ w_gate_up[e]
        h = gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:]
        y[t] += float(w[t, k]) * (h @ w_down[e])
    return y


def operands(t, k, e, d, f, *, seed=0, ids=None, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, d)).astype(dtype)
    if ids is None:  # distinct experts per row, unsorted (as top-k returns them)
        ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    w = rng.random(ids.shape).astype(np.float32)
    w_gu = (rng.standard_normal((e, d, 2 * f)) / np.sqrt(d)).astype(dtype)
    w_dn = (rng.standard_normal((e, f, d)) / np.sqrt(f)).astype(dtype)
    return x, ids, w, w_gu, w_dn


# (T, K, E, D, F, tf): one row; T*K > E (every expert active); one slot per block of F;
# T not a multiple of the sublane tile.
SHAPES = [
    (1, 2, 8, 128, 256, 128),
    (5, 3, 4, 128, 128, 128),
    (9, 2, 16, 256, 384, 128),
    (3, 4, 6, 128, 256, None),
]


@pytest.mark.parametrize(("t", "k", "e", "d", "f", "tf"), SHAPES)
def test_matches_the_float64_oracle(t, k, e, d, f, tf):
    x, ids, w, w_gu, w_dn = operands(t, k, e, d, f)
    got = md.fused_moe(*map(jnp.asarray, (x, ids, w, w_gu, w_dn)), block_f=tf, interpret=True)
    want = oracle(x, ids, w, w_gu, w_dn)
    # float32 operands, f32 accumulation over D and F: 1e-5 relative to the largest output.
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(("t", "k", "e", "d", "f", "tf"), SHAPES[1:3])
def test_d_split_kernels_match_the_float64_oracle(t, k, e, d, f, tf):
    # fused_gate_up -> SwiGLU x slot weights -> fused_down: what one shard of D-split (fsdp)
    # weights runs around its psum, here on one device (the psum is the identity).
    x, ids, w, w_gu, w_dn = operands(t, k, e, d, f, seed=3)
    got = mds.split_reference(*map(jnp.asarray, (x, ids, w, w_gu, w_dn)), interpret=True)
    want = oracle(x, ids, w, w_gu, w_dn)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_repeated_ids_add_and_out_of_range_ids_select_nothing():
    ids = np.array([[3, 3], [0, 5], [-1, 2], [2, 2]], np.int32)  # 5 and -1 are outside [0, 4)
    x, ids, w, w_gu, w_dn = operands(4, 2, 4, 128, 128, ids=ids)
    got = md.fused_moe(*map(jnp.asarray, (x, ids, w, w_gu, w_dn)), interpret=True)
    want = oracle(x, ids, w, w_gu, w_dn)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_no_active_expert_gives_zeros():
    x, ids, w, w_gu, w_dn = operands(2, 2, 4, 128, 128, ids=np.full((2, 2), 7, np.int32))
    got = md.fused_moe(*map(jnp.asarray, (x, ids, w, w_gu, w_dn)), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_tpu_faithful_interpreter_and_bfloat16():
    # InterpretParams: uninitialised VMEM is NaN, a DMA lands only when it is waited on, and
    # races between the kernel's own DMAs and its reads of the buffers raise. Two F blocks per
    # slot, so the weight stream alternates its buffers within and across slots. bf16
    # operands, f32 accumulation: bf16's rounding of h and of y, 2e-2 relative to the largest
    # output.
    x, ids, w, w_gu, w_dn = operands(6, 2, 8, 128, 256, seed=1)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, w_gu, w_dn)]
    got = md.fused_moe(
        bf[0],
        jnp.asarray(ids),
        jnp.asarray(w),
        bf[1],
        bf[2],
        block_f=128,
        interpret=pltpu.InterpretParams(detect_races=True),
    )
    assert got.dtype == jnp.bfloat16
    want = oracle(*(np.asarray(a, np.float64) for a in (bf[0], ids, w, bf[1], bf[2])))
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, atol=2e-2 * np.abs(want).max(), rtol=0
    )


def test_d_split_kernels_under_the_tpu_faithful_interpreter():
    # The D-split pair's weight streams, as above: 3 F blocks per slot, float32 (1e-5).
    x, ids, w, w_gu, w_dn = operands(5, 2, 8, 128, 384, seed=4)
    got = mds.split_reference(
        *map(jnp.asarray, (x, ids, w, w_gu, w_dn)),
        block_f=128,
        interpret=pltpu.InterpretParams(detect_races=True),
    )
    want = oracle(x, ids, w, w_gu, w_dn)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize(
    ("t", "k", "ids", "tf"),
    [
        (4, 2, [[0, 3], [3, 5], [5, 0], [0, 0]], 256),  # 3 of 8 experts active, one F block
        (4, 2, [[0, 3], [3, 5], [5, 0], [0, 0]], 128),  # the same, two F blocks per slot
        (2, 2, [[9, -1], [8, 12]], 128),  # no expert active: nothing copied, y = 0
        (1, 1, [[6]], 256),  # S = 1, J = 1
    ],
)
def test_inactive_slots_under_the_tpu_faithful_interpreter(t, k, ids, tf):
    # Slots past the active count, no active slot at all, and one-slot one-block grids, with
    # DMAs that land only when waited on and race detection: the single kernel and the D-split
    # pair against the float64 oracle (float32, 1e-5 of the largest output).
    ids = np.asarray(ids, np.int32)
    x, ids, w, w_gu, w_dn = operands(t, k, 8, 128, 256, seed=5, ids=ids)
    args = [jnp.asarray(a) for a in (x, ids, w, w_gu, w_dn)]
    params = pltpu.InterpretParams(detect_races=True)
    want = oracle(x, ids, w, w_gu, w_dn)
    scale = max(np.abs(want).max(), 1.0)
    for got in (
        md.fused_moe(*args, block_f=tf, interpret=params),
        mds.split_reference(*args, block_f=tf, interpret=params),
    ):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale, rtol=0)


def test_matches_the_jnp_reference():
    args = [jnp.asarray(a) for a in operands(4, 2, 8, 128, 256, seed=2)]
    got = md.fused_moe(*args, interpret=True)
    want = md.fused_moe_reference(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_active_slots_are_sorted_distinct_and_padded_with_the_last():
    slots, n = md.active_slots(jnp.asarray([[5, 1], [1, 3], [9, -2]], jnp.int32), 8)
    assert int(n[0]) == 3 and np.asarray(slots).tolist() == [1, 3, 5, 5, 5, 5]


def test_default_block_f_fits_the_budget():
    # Qwen3-30B-A3B (D=2048, F=768, bf16): 6 x D x tf x 2 bytes <= 12 MiB -> tf = 384.
    assert md.default_block_f(2048, 768, 2) == 384
    assert md.default_block_f(7168, 2048, 2) == 128  # DeepSeek-V3: the smallest lane tile
    assert md.default_block_f(32, 16, 4) == 16  # F below a lane: one block of F


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": (3, 64)}, r"w_gate_up must be \[E, D=64"),
        ({"ids": (2, 2)}, r"ids_TK and w_TK must both be \[T=3"),
        ({"w_down": (4, 128, 64)}, r"w_down must be \[E=4, F=128, D=128\]"),
        ({"block_f": 96}, r"block_f=96 must divide moe_intermediate_size F=128"),
        ({"f": 64, "interpret": False}, r"F=64 is not a multiple of 128"),
    ],
)
def test_bad_inputs_raise(change, match):
    x, ids, w, w_gu, w_dn = operands(3, 2, 4, 128, change.get("f", 128))
    if "x" in change:
        x = np.zeros(change["x"], np.float32)
    if "ids" in change:
        ids = np.zeros(change["ids"], np.int32)
        w = np.zeros(change["ids"], np.float32)
    if "w_down" in change:
        w_dn = np.zeros(change["w_down"], np.float32)
    with pytest.raises(ValueError, match=match):
        md.fused_moe(
            x,
            ids,
            w,
            w_gu,
            w_dn,
            block_f=change.get("block_f"),
            interpret=change.get("interpret", True),
        )


@functools.cache
def _device(chip: str):
    return tpu_devices(TOPOLOGY_BY_CHIP[chip])[0]


def _layer_args(chip, rows, d, f, e, k):
    """Abstract bf16 operands of fused_moe / split_reference on one `chip` device: x, ids,
    combine weights, w_gate_up, w_down."""
    sharding = SingleDeviceSharding(_device(chip))
    shapes = [
        ((rows, d), jnp.bfloat16),
        ((rows, k), jnp.int32),
        ((rows, k), jnp.float32),
        ((e, d, 2 * f), jnp.bfloat16),
        ((e, f, d), jnp.bfloat16),
    ]
    return [jax.ShapeDtypeStruct(s, dt, sharding=sharding) for s, dt in shapes]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
def test_compiles_with_mosaic_for_tpu(chip, rows):
    # Qwen3-30B-A3B's layer: D=2048, F=768, E=128, K=8, bf16.
    d, f, e, k = 2048, 768, 128, 8
    args = _layer_args(chip, rows, d, f, e, k)
    with target.compiling_for(chip):
        compiled = jax.jit(md.fused_moe).lower(*args).compile()
    text = compiled.as_text()
    # The Mosaic kernel itself, not an interpreted loop, is in the TPU executable.
    assert "tpu_custom_call" in text and "moetext_fused_moe" in text
    assert compiled.out_info.shape == (rows, d)
    # The step-cost walk counts the kernel's estimate (at most S = min(E, T*K) experts' weights
    # plus x, y and the routing), not its whole [E, ...] weight operands.
    slabs = min(e, rows * k) * 3 * d * f * 2
    assert slabs <= hlo_cost(text).hbm_bytes <= slabs + 4 * (rows + 16) * d * 2 + 2e5


@pytest.mark.tpu_aot
@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
def test_d_split_kernels_compile_with_mosaic_for_tpu(chip):
    # One fsdp-8 shard of Qwen3-30B-A3B's layer: D / 8 = 256 columns of every expert, 8 rows.
    d, f, e, k, rows = 256, 768, 128, 8, 8
    args = _layer_args(chip, rows, d, f, e, k)
    with target.compiling_for(chip):
        compiled = jax.jit(mds.split_reference).lower(*args).compile()
    text = compiled.as_text()
    assert "moetext_fused_gate_up" in text and "moetext_fused_down" in text
    assert compiled.out_info.shape == (rows, d)
