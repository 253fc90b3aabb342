"""QAG (kernels/fp8/qag.py, gmm's rhs_gather): the quantized all-gather equals quantizing the
gathered weights bit for bit, and gmm on a sharded weight slice gives the unsharded answer.

The 8-device checks run in one fresh interpreter (WORKER, 8 fake CPU devices on a 2 x 4 mesh)
that prints one JSON line. Oracles: Quantized.of on the full array (bitwise), the same
QuantizedGmm on the gathered weight with save_rhs="fp8" (bitwise: both paths multiply the same
FP8 numbers), the plain gmm on the full weight (rhs_gather without quantization, float32).

On CPU, XLA widens collectives it cannot run natively (f8 and bf16 all-gathers compile to f16 and
f32), so "FP8 on the wire" is checked where it is decided: in the lowered StableHLO on CPU, and
in the compiled HLO of a TPU (v5p) ahead-of-time compile.

Budget: ~40 s on 2 cores (one subprocess), plus ~15 s for the TPU compile.
"""

import os
import re

import numpy as np
import pytest

from fake_devices import run_result

WORKER = r"""
import json, re
import moetext  # noqa: F401
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, PartitionSpec as P
from moetext.kernels import fp8, gmm as gmm_lib
from moetext.kernels.fp8.qag import quantized_all_gather
from moetext.kernels.gmm.gather import gather_weight

mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
res = {"qag": {}, "gmm": {}, "plain": {}, "hlo": {}}

def gather_of(spec):
    return tuple((d, (s,) if isinstance(s, str) else s) for d, s in enumerate(spec) if s)

# 1. quantized_all_gather == Quantized.of(full), bitwise, for shard sizes below / at / above a
#    block, a ragged unsharded blocked axis, square tiles split over two mesh axes, e5m2.
CASES = {
    "straddle_n64_bs128": ((4, 512, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "aligned_n256_bs128": ((4, 2048, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "gcd16_n48_bs128": ((4, 384, 96), (None, ("a", "b"), None), 1, 128, "float8_e4m3fn"),
    "ragged_unsharded_axis": ((4, 384, 100), (None, "b", None), 2, 128, "float8_e4m3fn"),
    "tiles_two_axes": ((4, 384, 256), (None, "a", "b"), None, 128, "float8_e4m3fn"),
    "gcd1_n5_bs16": ((4, 40, 24), (None, ("a", "b"), None), 1, 16, "float8_e4m3fn"),
    "e5m2_experts_dim_too": ((8, 256, 64), ("a", "b", None), 1, 32, "float8_e5m2"),
}
for name, (shape, spec, axis, bs, dt) in CASES.items():
    x = jnp.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape), jnp.bfloat16)
    x = x.at[0, :64].set(0)  # all-zero blocks
    fn = jax.shard_map(
        lambda xl: quantized_all_gather(xl, gather_of(spec), axis=axis, block_size=bs, dtype=dt),
        mesh=mesh, in_specs=P(*spec), out_specs=P(), check_vma=False)
    got = jax.jit(fn)(x)
    ref = fp8.Quantized.of(x, axis=axis, block_size=bs, dtype=dt, impl="xla")
    res["qag"][name] = {
        "value_equal": bool(np.array_equal(np.asarray(got.value, np.float32),
                                           np.asarray(ref.value, np.float32))),
        "scale_equal": bool(np.array_equal(np.asarray(got.scale), np.asarray(ref.scale))),
        "axis_equal": got.axis == ref.axis,
    }

# 2. gmm on a weight slice (rhs_gather), QAG vs gathering in bf16 and quantizing the copy.
M, K, N, G = 48, 256, 96, 4
x = jnp.asarray(rng.standard_normal((8 * M, K)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((G, K, N)) * 0.1, jnp.float32)  # f32 master weights
wt = jnp.swapaxes(w, 1, 2)  # [G, N, K] for transpose_rhs
gs = jnp.asarray([10, 20, 0, 18], jnp.int32)  # per shard: 48 rows, one empty group

def grads(backend, *, transpose=False, gathered_outside=False, w=w, reduce_dtype=None):
    spec = P(None, ("a", "b"), None)  # split along K (the contraction) like fsdp on D
    gather = ((2 if transpose else 1, ("a", "b")),)
    spec = P(None, None, ("a", "b")) if transpose else spec
    def body(xl, wl):
        kw = dict(backend=backend, preferred_element_type=jnp.bfloat16, transpose_rhs=transpose)
        if gathered_outside:
            full = gather_weight(wl, gather, jnp.bfloat16)  # the plain path, outside the backend
            return gmm_lib.gmm(xl, full, gs, **kw)
        return gmm_lib.gmm(xl, wl, gs, rhs_gather=gather, grad_reduce_dtype=reduce_dtype, **kw)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), spec),
                      out_specs=P(("a", "b")), check_vma=False)
    loss = lambda x, w: jnp.sum(jnp.sin(f(x, w).astype(jnp.float32)))
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w)
    v, (gx, gw) = lowered.compile()(x, w)
    return [np.asarray(a, np.float64) for a in (v, gx, gw)], lowered.as_text()

def rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

def quantized(name, qag, **recipe):
    r = fp8.Fp8Recipe(block_size=64, qag=qag, **recipe)  # 32-wide K shards: 2 per block
    return fp8.QuantizedGmm(gmm_lib.get_backend(name), r)

for name in ("reference", "ragged_dot", "blocked"):
    for bwd, wb in ((False, "1x64"), (True, "64x64"), (True, "1x64")):
        for transpose in (False, True) if name == "blocked" else (False,):
            key = f"{name}/bwd_quantize={bwd}/{wb}/transpose={transpose}"
            rec = dict(bwd_quantize=bwd, weight_block=wb)
            kw = dict(transpose=transpose, w=wt if transpose else w)
            q, _ = grads(quantized(name, True, **rec), **kw)
            ref, _ = grads(quantized(name, False, save_rhs="fp8", **rec), gathered_outside=True,
                           **kw)
            inp, _ = grads(quantized(name, False, **rec), **kw)
            res["gmm"][key] = {
                "vs_fp8_saved": [rel(a, b) for a, b in zip(q, ref)],
                "vs_input_saved": [rel(a, b) for a, b in zip(q, inp)],
            }

# 3. rhs_gather without quantization == the gmm on the full f32 weight (outside shard_map).
for name in ("reference", "blocked"):
    got, text = grads(name, w=w)
    # Every shard uses the same group sizes, so the oracle runs each 48-row block on its own.
    def loss(x, w):
        ys = [gmm_lib.gmm(xb, w.astype(jnp.bfloat16), gs, backend=name,
                          preferred_element_type=jnp.bfloat16) for xb in jnp.split(x, 8)]
        return jnp.sum(jnp.sin(jnp.concatenate(ys).astype(jnp.float32)))
    v, (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    want = [np.asarray(a, np.float64) for a in (v, gx, gw)]
    res["plain"][name] = [rel(a, b) for a, b in zip(got, want)]
    res["hlo"]["plain_" + name] = sorted(set(re.findall(
        r"stablehlo\.all_gather.*?->\s*tensor<[0-9x]*x(\w+)>", text)))

_, text = grads(quantized("blocked", True, bwd_quantize=False, weight_block="1x64"), w=w)
res["hlo"]["qag"] = sorted(set(re.findall(r"stablehlo\.all_gather.*?->\s*tensor<[0-9x]*x(\w+)>",
                                          text)))
RS = r"stablehlo\.reduce_scatter.*?->\s*tensor<[0-9x]*x(\w+)>"
res["hlo"]["qag_reduce_scatter"] = sorted(set(re.findall(RS, text, re.S)))

# 4. grad_reduce_dtype=bfloat16: the weight gradient is reduce-scattered in bf16 (plain and QAG).
f32_reduced, _ = grads("blocked", w=w)
bf16_reduced, text = grads("blocked", w=w, reduce_dtype=jnp.bfloat16)
res["bf16_reduce"] = {"rel": [rel(a, b) for a, b in zip(bf16_reduced, f32_reduced)],
                      "dtypes": sorted(set(re.findall(RS, text, re.S)))}
q = quantized("blocked", True, bwd_quantize=False, weight_block="1x64")
_, text = grads(q, w=w, reduce_dtype=jnp.bfloat16)
res["bf16_reduce"]["qag_dtypes"] = sorted(set(re.findall(RS, text, re.S)))
print("RESULT " + json.dumps(res))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("qag") / "worker.py"
    path.write_text(WORKER)
    return run_result([str(path)], timeout_s=600)


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
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moetext.kernels import fp8
    from moetext.kernels import gmm as gmm_lib

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = Mesh(np.array(devices).reshape(4), ("fsdp",))
    backend = fp8.QuantizedGmm(gmm_lib.get_backend("ragged_dot"), fp8.Fp8Recipe(qag=True))
    e, d, f, m = 8, 1024, 256, 512

    def body(x, w):
        return gmm_lib.gmm(
            x,
            w,
            jnp.full((e,), m // e, jnp.int32),
            backend=backend,
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
