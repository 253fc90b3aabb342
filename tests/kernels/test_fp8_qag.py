"""QAG (kernels/quant/qag.py, gmm's rhs_gather): the quantized all-gather equals quantizing the
gathered weights bit for bit, and gmm on a sharded weight slice gives the unsharded answer.

The 8-device checks run in one fresh interpreter (qag_worker.py, 8 fake CPU devices on a 2 x 4
mesh) that prints one JSON line. Oracles: Quantized.of on the full array (bitwise), the same
fp8_blockwise recipe on the gathered weight with save_rhs="fp8" (bitwise: both paths multiply
the same FP8 numbers), the plain gmm on the full weight (rhs_gather without quantization, f32).

On CPU, XLA widens collectives it cannot run natively (f8 and bf16 all-gathers compile to f16 and
f32), so "FP8 on the wire" is checked where it is decided: in the lowered StableHLO on CPU, and
in the compiled HLO of a TPU (v5p) ahead-of-time compile.

Budget: ~40 s on 2 cores (one subprocess), plus ~15 s for the TPU compile.
"""

import re

import numpy as np
import pytest

from fake_devices import run_worker_once


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_worker_once(tmp_path_factory, "tests.kernels.qag_worker", timeout_s=600)


def test_quantized_all_gather_is_bitwise_the_full_quantization(result):
    # Every shard layout, incl. shards smaller than a block (their amaxes are combined).
    for name, r in result["qag"].items():
        assert r == {"value_equal": True, "scale_equal": True, "axis_equal": True}, name


def test_qag_gmm_equals_quantizing_the_gathered_weight(result):
    for key, r in result["gmm"].items():
        loss, gx, gw = r["vs_fp8_saved"]
        assert loss == 0.0, key  # same FP8 operands -> bitwise the same forward
        assert gw < 1e-6, key  # psum_scatter of the same per-shard tgmm (order of the sum)
        if "bwd_quantize=True/1x64" in key:
            # The FP8 backward re-blocks the dequantized FP8 weight along N (the bf16 one is
            # never gathered): one more e4m3 rounding of the weight, bounded like FP8 itself.
            assert gx < 0.06, key
        else:
            assert gx == 0.0, key
        # Against the default recipe (bf16 gathered weight kept for the backward): forward
        # identical, dlhs differs by the weight's FP8 rounding (measured 2.6-4.2%).
        loss_i, gx_i, _ = r["vs_input_saved"]
        assert loss_i == 0.0 and gx_i < 0.06, key


# A tile of the weight gradient is a dot of another shape than the whole ([K, T] @ [T, 8] vs
# [T, 96] columns), and XLA:CPU picks a dot's blocking from its shapes and the host's vector
# width (AVX2, AVX-512): the same float32 products may be summed in another order. Bitwise on
# one host, 1.23e-5 of the largest entry on another (AMD EPYC, avx512_bf16, 2026-11-27), so the
# claim is a bound, not equality. Per shard, the tgmm's float32 sum of T <= 20 rows may differ by
# 2 * T * 2^-24 of its sum of |products|, and its bf16 output may then round one ulp apart
# (<= 2^-7 of that sum); the shards' partials are summed in float32 in the same order either way.
# Summed over shards: (2^-7 + 2 * T * 2^-24) * sum_r |x[r, k]| * |dout| per entry, relative to
# the largest entry that is drhs_abs_scale (qag_worker) times the factor. The FP8 backward's
# operands are e4m3 roundings of x and dout, each at most 2^-4 larger: (1 + 2^-4)^2 more.
# Measured (AVX2, 2026-11-27): drhs_abs_scale 3.6-3.75, so bounds 0.029 (bf16) and 0.032 (FP8)
# against differences of 0 (bf16; 1.23e-5 on the avx512_bf16 host) and <= 8.1e-4 (FP8).
TILE_ROWS = 20  # the largest group of a shard (qag_worker.GROUP_SIZES)
BF16_PARTIALS_REORDERED = 2.0**-7 + 2 * TILE_ROWS * 2.0**-24
FP8_OPERANDS = (1 + 2.0**-4) ** 2


def test_qag_weight_gradient_in_column_tiles(result):
    # The QAG backward reduce-scatters the weight gradient a column tile at a time (as the bf16
    # path does): tiles of the FP8 operands blocked along M keep their scales, so each tile is
    # the one-piece gradient's columns, up to the order of its sums (above). A misplaced tile
    # or scale would be off by the entries themselves (relative difference ~1). The forward and
    # dlhs run the same ops on the same shapes either way: bitwise.
    tiled = {k: r for k, r in result["gmm"].items() if "tiled_vs_whole" in r}
    assert len(tiled) == 6, sorted(tiled)
    for key, r in tiled.items():
        loss, gx, gw = r["tiled_vs_whole"]
        assert loss == 0.0 and gx == 0.0, (key, loss, gx)
        fp8 = FP8_OPERANDS if "bwd_quantize=True" in key else 1.0
        bound = BF16_PARTIALS_REORDERED * fp8 * r["drhs_abs_scale"]
        assert gw <= bound, (key, gw, bound)


def test_plain_rhs_gather_equals_the_full_weight(result):
    # bf16 compute either way; the weight gradient is summed over shards in f32 by
    # psum_scatter instead of inside one tgmm: a bf16 rounding apart at most.
    for name, (loss, gx, gw) in result["plain"].items():
        assert loss < 1e-6 and gx < 1e-6 and gw < 2**-7, (name, loss, gx, gw)


def test_qag_puts_fp8_on_the_wire(result):
    hlo = result["hlo"]
    assert hlo["plain_blocked"] == ["bf16"]  # cast to the compute dtype before the gather
    # FP8 values plus the bf16 block amaxes; the f32 master weights never cross the wire.
    assert hlo["qag"] == ["bf16", "f8E4M3FN"]
    assert hlo["qag_reduce_scatter"] == ["f32"]  # gradient reduced in the master dtype


def test_bf16_gradient_reduction(result):
    r = result["bf16_reduce"]
    assert r["dtypes"] == ["bf16"] and r["qag_dtypes"] == ["bf16"], r
    loss, gx, gw = r["rel"]
    assert loss == 0.0 and gx == 0.0, r  # the forward and dlhs do not see the reduction
    # 8 bf16 partial gradients summed in bf16 instead of f32: a few bf16 roundings (2^-8 each)
    # of the largest entry; measured below 2^-7.
    assert 0.0 < gw < 2**-6, r


@pytest.mark.tpu_aot
def test_qag_all_gathers_fp8_in_compiled_tpu_hlo():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moetext.aot import tpu_devices
    from moetext.kernels import gmm as gmm_lib
    from moetext.kernels.quant import Fp8Blockwise

    devices = tpu_devices("v5p:2x2x1")
    mesh = Mesh(np.array(devices).reshape(4), ("fsdp",))
    op = gmm_lib.Gmm(gmm_lib.get_backend("ragged_dot"), Fp8Blockwise(qag=True))
    e, d, f, m = 8, 1024, 256, 512

    def body(x, w):
        return op(
            x,
            w,
            jnp.full((e,), m // e, jnp.int32),
            preferred_element_type=jnp.bfloat16,
            rhs_gather=((1, ("fsdp",)),),
        )

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("fsdp"), P(None, "fsdp", None)),
        out_specs=P("fsdp"),
        check_vma=False,
    )
    loss = lambda x, w: jnp.sum(jnp.sin(fn(x, w).astype(jnp.float32)))
    args = (
        jax.ShapeDtypeStruct((4 * m, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp"))),
        jax.ShapeDtypeStruct(
            (e, d, f), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp", None))
        ),
    )
    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    gathers = re.findall(r"=\s*(\w+)\[[0-9,]*\][^ ]*\s+all-gather(?:-start)?\(", hlo)
    # The weight crosses the wire as e4m3 (f8e4m3fn[8, 1024, 256]) plus bf16 amaxes.
    assert sorted(set(gathers)) == ["bf16", "f8e4m3fn"], gathers
    scatters = re.findall(r"=\s*(\w+)\[[0-9,]*\][^ ]*\s+reduce-scatter(?:-start)?\(", hlo)
    assert scatters == ["f32"], scatters  # the weight gradient, reduce-scattered in f32
