"""moetext.step_cost: FLOPs and HBM bytes of compiled TPU programs with scanned loops counted per
trip, and the roofline arithmetic.

Programs are compiled for one v5e device (libtpu, no TPU): a stack of L matmuls, as a
lax.scan (what scan_layers compiles to) and unrolled. The FLOPs oracle is exact arithmetic
(2 M K N per matmul, three matmuls per layer with its gradient); XLA's own cost analysis
counts the while body once, which is what hlo_cost corrects.
"""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from moetext import aot, hlo, hlo_cost, step_cost

L, M, K = 4, 256, 512


def _stack(w, x):
    def body(c, wi):
        return jnp.tanh(c @ wi), None

    return jax.lax.scan(body, x, w)[0].sum()


def _unrolled(w, x):
    for i in range(L):
        x = jnp.tanh(x @ w[i])
    return x.sum()


@pytest.fixture(scope="module")
def args():
    s = SingleDeviceSharding(aot.tpu_devices("v5e:2x2")[0])
    w = jax.ShapeDtypeStruct((L, K, K), jnp.bfloat16, sharding=s)
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=s)
    return w, x


def _compile(fn, args):
    return jax.jit(fn).lower(*args).compile()


def test_scanned_matmul_flops_count_every_trip(args):
    fwd = _compile(_stack, args)
    assert hlo_cost.hlo_cost(fwd.as_text()).flops == 2 * M * K * K * L
    # XLA counts the while body once: a quarter of the dots (plus its elementwise ops).
    assert fwd.cost_analysis()["flops"] < 2 * M * K * K * 1.1
    # The gradient w.r.t. the weights: forward, dx and dw matmuls of every layer.
    grad = _compile(jax.grad(_stack), args)
    assert hlo_cost.hlo_cost(grad.as_text()).flops == 3 * 2 * M * K * K * L


def test_scanned_and_unrolled_stacks_cost_alike(args):
    scan = hlo_cost.hlo_cost(_compile(_stack, args).as_text())
    loop = hlo_cost.hlo_cost(_compile(_unrolled, args).as_text())
    assert scan.flops == loop.flops
    # Bytes: every layer reads its input x [M, K] and weight [K, K] and writes its output, bf16;
    # both programs move at least that. In the scan each trip's matmul fusion moves exactly that
    # (the weight through a dynamic-slice of the stack, plus the s32 trip index, 4 bytes); the
    # scan's carry copies come on top, and the unrolled program fuses across layers, so their
    # totals differ (7.08 vs 5.51 MB measured).
    per_layer = (2 * M * K + K * K) * 2
    assert scan.hbm_bytes >= L * per_layer and loop.hbm_bytes >= L * per_layer
    matmul = max(v for key, v in scan.top_bytes if key.startswith("fusion ") and f"x{L}" in key)
    assert matmul == L * (per_layer + 4), (matmul, scan.top_bytes)


def test_loop_free_bytes_are_near_xla_cost_analysis(args):
    # Without loops XLA's 'bytes accessed' is the reference: the HLO walk follows its rules
    # (operands read, results written, fusions as units, dynamic slices counted as sliced).
    # Measured ratio 1.20 on this program (libtpu 0.0.50): XLA drops some operands it knows
    # stay in on-chip memory; the bound states that, not equality.
    c = _compile(jax.grad(_unrolled), args)
    ours = hlo_cost.hlo_cost(c.as_text()).hbm_bytes
    xla = c.cost_analysis()["bytes accessed"]
    assert 0.9 < ours / xla < 1.35, (ours, xla)


def test_roofline_bounds_and_mfu():
    chip = step_cost.Chip("test", 100e12, 1e12, 50e9, "a test chip")
    r = step_cost.roofline(
        chip=chip,
        model_flops=60e12,
        compiled_flops=80e12,
        hbm_bytes_accessed=0.5e12,
        ici_bytes=30e9,
    )
    assert r["compute_s"] == pytest.approx(0.8)
    assert r["hbm_s"] == pytest.approx(0.5)
    assert r["ici_s"] == pytest.approx(0.3)  # 30 GB over two 50 GB/s links
    assert r["step_s_low"] == pytest.approx(0.8) and r["dominant"] == "compute"
    assert r["step_s_high"] == pytest.approx(1.1)
    assert r["mfu_high"] == pytest.approx(60 / 80)
    assert r["mfu_low"] == pytest.approx(60 / 110)
    assert r["recompute_ratio"] == pytest.approx(80 / 60)


def test_chip_table_is_per_jax_device():
    v5p, tpu7x = step_cost.chip_of("v5p:4x4x2"), step_cost.chip_of("tpu7x:2x2x1")
    assert v5p.bf16_flops_per_s == 459e12 and v5p.hbm_bytes_per_s == 2765e9
    assert v5p.ici_link_bytes_per_s == 1200e9 / 12  # 6 ports, both directions
    assert math.isclose(tpu7x.bf16_flops_per_s, 2307e12 / 2)  # a device is half a chip
    with pytest.raises(aot.TopologyError, match="v9"):
        step_cost.chip_of("v9:2x2")


def test_batched_dots_count_each_batch_once(args):
    # XLA:TPU may write a dot's batch dims as convolution windows (size n, padding n - 1): only
    # one tap per output lands on real input, so the FLOPs are the dot's, not n times them.
    s = args[0].sharding
    q = jax.ShapeDtypeStruct((4, 128, 64), jnp.float32, sharding=s)
    k = jax.ShapeDtypeStruct((4, 256, 64), jnp.float32, sharding=s)
    c = _compile(lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), (q, k))
    assert hlo_cost.hlo_cost(c.as_text()).flops == 2 * 4 * 128 * 256 * 64


def test_conditional_branches_count_as_run(args):
    # A cond inside the scan (as the blocked gmm skips empty tiles): each branch counted once
    # per trip, an upper bound (the zero branch has no FLOPs, so here it is exact).
    def f(w, x):
        def body(c, wi):
            y = jax.lax.cond(c[0, 0] > -1e9, lambda: c @ wi, lambda: jnp.zeros_like(c))
            return y.astype(c.dtype), None

        return jax.lax.scan(body, x, w)[0].sum()

    c = _compile(f, args)
    assert hlo_cost.hlo_cost(c.as_text()).flops == 2 * M * K * K * L


# XLA:TPU runs some ops as async calls (gathers offloaded to the SparseCore on v5p; on TPU7x the
# collectives too): call-start, call-update(s), call-done. The wrapped computation reads its
# parameter and writes its result once (f32[4,8] in, f32[16,8] out: 128 + 512 bytes); the
# update and done steps, whose shapes repeat those buffers, add nothing.
ASYNC_CALL_HLO = """\
HloModule jit_async_call

%called_computation.1 (param_0.1: f32[4,8]) -> f32[16,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  ROOT %all-gather.1 = f32[16,8]{1,0} all-gather(%param_0.1), replica_groups={{0,1,2,3}}, \
dimensions={0}
}, execution_thread="sparsecore"

ENTRY %main (a: f32[4,8]) -> f32[16,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %cs = ((f32[4,8]{1,0}), f32[16,8]{1,0}) call-start(%a), async_execution_thread="sparsecore", \
to_apply=%called_computation.1
  %cu = ((f32[4,8]{1,0}), f32[16,8]{1,0}) call-update(%cs)
  ROOT %cd = f32[16,8]{1,0} call-done(%cu)
}
"""


# XLA's dumps (MaxText's rows are read from them) print the same async call as async-start
# (wrapped computation in calls=, often with no operands), async-update (given the data) and
# async-done: counted once, as the call-start form is.
ASYNC_START_HLO = """\
HloModule jit_async_start

%called_computation.1 (param_0.1: f32[4,8]) -> f32[16,8] {
  %param_0.1 = f32[4,8]{1,0} parameter(0)
  ROOT %all-gather.1 = f32[16,8]{1,0} all-gather(%param_0.1), replica_groups={{0,1,2,3}}, \
dimensions={0}
}, execution_thread="sparsecore"

%async_computation.1 (param_0.2: f32[4,8]) -> f32[16,8] {
  %param_0.2 = f32[4,8]{1,0} parameter(0)
  ROOT %c = f32[16,8]{1,0} call(%param_0.2), to_apply=%called_computation.1
}, execution_thread="sparsecore"

ENTRY %main (a: f32[4,8]) -> f32[16,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %cs = ((), (), (s32[1]{0})) async-start(), async_execution_thread="sparsecore", \
calls=%async_computation.1
  %cu = ((f32[4,8]{1,0}), f32[16,8]{1,0}) async-update(%cs, %a)
  ROOT %cd = f32[16,8]{1,0} async-done(%cu)
}
"""


def test_async_call_bytes_count_once():
    assert hlo_cost.hlo_cost(ASYNC_CALL_HLO).hbm_bytes == 4 * 8 * 4 + 16 * 8 * 4
    assert hlo_cost.hlo_cost(ASYNC_START_HLO).hbm_bytes == 4 * 8 * 4 + 16 * 8 * 4


# XLA:TPU on TPU7x reads one layer of the scan's stacked residuals [L, ...] through a nested
# copy fusion that re-tiles the whole stack (T(16,128) -> T(8,128)) inside the consumer fusion,
# followed by a dynamic-slice of one layer. Emitted in the consumer's loop, the copy reads only
# the slice: bf16[1,8,128] = 2048 bytes read of the 8-layer stack, plus 4 (the index) and 2048
# written; counting the whole stack (16384 bytes) inflated the 235B tpu7x row by 3.3 TB.
RELAYOUT_SLICE_HLO = """\
HloModule jit_relayout_slice

%copy_fusion.1 (input.1: bf16[8,8,128]) -> bf16[8,8,128] {
  %input.1 = bf16[8,8,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %copy.1 = bf16[8,8,128]{2,1,0:T(8,128)(2,1)} copy(%input.1)
}

%fused_computation.1 (param_0.1: bf16[8,8,128], param_1.1: s32[]) -> bf16[8,128] {
  %param_0.1 = bf16[8,8,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %fusion.2 = bf16[8,8,128]{2,1,0:T(8,128)(2,1)} fusion(%param_0.1), kind=kLoop, \
output_to_operand_aliasing={{}: (0, {})}, calls=%copy_fusion.1
  %param_1.1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,8,128]{2,1,0:T(8,128)(2,1)} dynamic-slice(%fusion.2, %param_1.1, %zero, %zero), \
dynamic_slice_sizes={1,8,128}
  ROOT %bc = bf16[8,128]{1,0:T(8,128)(2,1)} bitcast(%ds)
}

ENTRY %main (stack: bf16[8,8,128], i: s32[]) -> bf16[8,128] {
  %stack = bf16[8,8,128]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = bf16[8,128]{1,0:T(8,128)(2,1)} fusion(%stack, %i), kind=kOutput, \
calls=%fused_computation.1
}
"""


def test_relayout_fusion_of_a_sliced_stack_reads_the_slice():
    assert hlo_cost.hlo_cost(RELAYOUT_SLICE_HLO).hbm_bytes == 2048 + 4 + 2048
    # The same stack used whole (the copy's result returned) is read whole.
    whole = RELAYOUT_SLICE_HLO.replace(
        "ROOT %bc = bf16[8,128]{1,0:T(8,128)(2,1)} bitcast(%ds)",
        "%bc = bf16[8,128]{1,0:T(8,128)(2,1)} bitcast(%ds)\n"
        "  ROOT %t = (bf16[8,128], bf16[8,8,128]) tuple(%bc, %fusion.2)",
    ).replace(
        "-> bf16[8,128] {\n  %param_0.1",
        "-> (bf16[8,128], bf16[8,8,128]) {\n  %param_0.1",
    )
    assert hlo_cost.hlo_cost(whole).hbm_bytes > 16384


# XLA:TPU's windowed einsum (an all-gather fused into its matmul as a loop of collective
# permutes and partial dots) counts its steps in u32 and records no known_trip_count: 16 trips
# here, each a [8, 16] x [16, 32] dot and one permute of the next [16, 32] weight chunk. Read as
# one trip, the Qwen3-30B-A3B fsdp step lost 7/8 of its attention projections' FLOPs. Its
# bidirectional form takes two chunks per trip and steps the counter by 2 (8 trips to 16).
WINDOWED_HLO = """\
HloModule jit_windowed, num_partitions=16

%cond (p: (u32[], bf16[8,16], bf16[16,32], f32[8,32])) -> pred[] {
  %p = (u32[], bf16[8,16], bf16[16,32], f32[8,32]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[]{:T(128)} constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (u32[], bf16[8,16], bf16[16,32], f32[8,32])) -> (u32[], bf16[8,16], bf16[16,32], \
f32[8,32]) {
  %q = (u32[], bf16[8,16], bf16[16,32], f32[8,32]) parameter(0)
  %i.1 = u32[] get-tuple-element(%q), index=0
  %x = bf16[8,16] get-tuple-element(%q), index=1
  %w = bf16[16,32] get-tuple-element(%q), index=2
  %acc = f32[8,32] get-tuple-element(%q), index=3
  %d = f32[8,32] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %acc.1 = f32[8,32] add(%acc, %d)
  %next = bf16[16,32] collective-permute(%w), source_target_pairs={{0,1},{1,0}}
  %one = u32[] constant(1)
  %i.2 = u32[] add(%i.1, %one)
  ROOT %t = (u32[], bf16[8,16], bf16[16,32], f32[8,32]) tuple(%i.2, %x, %next, %acc.1)
}

ENTRY %main (init: (u32[], bf16[8,16], bf16[16,32], f32[8,32])) -> (u32[], bf16[8,16], \
bf16[16,32], f32[8,32]) {
  %init = (u32[], bf16[8,16], bf16[16,32], f32[8,32]) parameter(0)
  ROOT %loop = (u32[], bf16[8,16], bf16[16,32], f32[8,32]) while(%init), condition=%cond, \
body=%body
}
"""


# XLA's dump form (MaxText's rows) reads the counter as `%param#k`, with no get-tuple-element.
_DUMP_FORM = (
    "  %i = u32[] get-tuple-element(%p), index=0\n",
    "",
    "compare(%i, %n), direction=LT",
    "compare(%p#0, %n), direction=LT",
)


@pytest.mark.parametrize("form", ["as_text", "dump"])
@pytest.mark.parametrize("step", [1, 2])
def test_windowed_einsum_loops_count_every_trip(step, form):
    text = WINDOWED_HLO.replace("%one = u32[] constant(1)", f"%one = u32[] constant({step})")
    if form == "dump":
        gte, none, cmp, cmp_dump = _DUMP_FORM
        assert gte in text and cmp in text
        text = text.replace(gte, none).replace(cmp, cmp_dump)
    trips = 16 // step
    assert hlo_cost.hlo_cost(text).flops == trips * 2 * 8 * 16 * 32
    permutes = hlo.collectives(text)[("collective-permute", "bf16")]
    assert permutes["count"] == trips and permutes["sent"] == trips * 16 * 32 * 2


def test_a_loop_condition_other_than_counter_below_bound_counts_once():
    # A count-down loop (i > 0) or any other condition is not read as a trip count.
    text = WINDOWED_HLO.replace("direction=LT", "direction=GT")
    assert hlo_cost.hlo_cost(text).flops == 2 * 8 * 16 * 32


def test_async_slice_counts_its_slice():
    # XLA:TPU streams a weight into VMEM as async slices: ((operand), slice, context). The walk
    # counts the slice read and written (2 x 128 x 2048 bf16), not the whole operand; the
    # tuple splits only at its top-level commas (a 2-D element once counted nothing).
    text = """HloModule m

ENTRY %main (p: bf16[1024,2048]) -> bf16[128,2048] {
  %p = bf16[1024,2048]{1,0} parameter(0)
  %s = ((bf16[1024,2048]{1,0}), bf16[128,2048]{1,0}, u32[]) slice-start(%p), slice={[0:128]}
  ROOT %d = bf16[128,2048]{1,0} slice-done(%s)
}
"""
    assert hlo.tuple_elements("((bf16[1024,2048]{1,0}), bf16[128,2048]{1,0}, u32[])") == [
        "(bf16[1024,2048]{1,0})",
        "bf16[128,2048]{1,0}",
        "u32[]",
    ]
    assert hlo_cost.hlo_cost(text).hbm_bytes == 2 * 128 * 2048 * 2
