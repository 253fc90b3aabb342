"""A fused MoE layer for decoding (Pallas Mosaic TPU): every active expert's weights read once.

Legend: T decode rows (1..~256), K experts per token, E experts, D emb_dim, F
moe_intermediate_size, S = min(E, T*K) expert slots, J = F / tf blocks of F per slot.

    y_TD = sum_k w_TK[t, k] * down_e(silu(x_t @ gate_e) * (x_t @ up_e)),  e = ids_TK[t, k]

with prefused w_gate_up [E, D, 2F] ([gate | up] on the last axis) and w_down [E, F, D]. A decode
step is memory-bound: the bytes are the active experts' weights, the FLOPs are negligible. So
outside the kernel the sorted distinct experts of ids_TK go into S slots (a slot past the active
count repeats the last active expert) and, with that count, reach the kernel as scalar prefetch.
The grid (S, J) visits slot s, block j. The weights stay in HBM (`pltpu.HBM` operands) and the
kernel copies what step (s, j) needs itself: expert slots[s]'s gate block (columns j), up block
(columns J + j) and down block (rows j), into one of two VMEM buffers while the step before
multiplies on the other (`WeightStream`). So each active expert's weights stream through VMEM
once, no [T, K, D, 2F] gather copy exists, and XLA cannot stage a whole [E, ...] weight in VMEM
ahead of the kernel (reading inactive experts too). Steps past the active count copy nothing
and skip their body. Per step, over ALL T rows (T is small; the FLOPs
of rows not routed to the expert are cheaper than gathering them):

    h_TF = silu(x_TD @ gate_Dtf) * (x_TD @ up_Dtf);  c_T = sum_k (ids_TK == e) * w_TK
    acc_TD += (c_T * h_TF) @ down_tfD            (f32 VMEM scratch; y written at the last step)

Routing (softmax / sigmoid, scaling factors) and shared experts stay outside: the kernel takes
the combine weights as given. `fused_moe_reference` is the same computation in jnp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from moetext.kernels.pallas import tiling as tiling_lib
from moetext.kernels.pallas.common import Dimensions, Interpret, Ref, resolve_interpret, round_up
from moetext.kernels.typed_jax import ShapeDtypeStruct

# Both grid axes accumulate into the one resident output block.
DIMENSIONS: Dimensions = ("arbitrary", "arbitrary")
# Double-buffered gate, up and down blocks stay under this many bytes when tf is picked:
# below v5e's 16 MiB default scoped VMEM with room for x, y and the accumulator.
WEIGHT_VMEM_BUDGET = 12 * tiling_lib.MiB


def default_block_f(d: int, f: int, itemsize: int, budget: int = WEIGHT_VMEM_BUDGET) -> int:
    """The largest tf dividing F, a multiple of 128 (or F itself), whose double-buffered gate,
    up and down blocks (3 x 2 x D x tf) fit `budget`; the smallest such tile if none fits."""
    fits = [t for t in range(f, 0, -1) if f % t == 0 and (t % tiling_lib.LANES == 0 or t == f)]
    for t in fits:
        if 6 * d * t * itemsize <= budget:
            return t
    return fits[-1]


def active_slots(ids_TK: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(slots_S int32, n_active int32 [1]): the distinct experts of ids_TK in ascending order,
    padded to S = min(E, T*K) with the last of them (ids outside [0, E) are ignored)."""
    s = min(num_experts, ids_TK.size)
    ids = ids_TK.reshape(-1)
    valid = (ids >= 0) & (ids < num_experts)
    used_E = (
        jnp.zeros((num_experts,), jnp.bool_)
        .at[jnp.where(valid, ids, num_experts)]
        .set(True, mode="drop")
    )
    n = jnp.sum(used_E.astype(jnp.int32))
    (found_S,) = jnp.nonzero(used_E, size=s, fill_value=0)
    last = found_S[jnp.maximum(n - 1, 0)]
    slots_S = jnp.where(jnp.arange(s) < n, found_S, last).astype(jnp.int32)
    return slots_S, n.reshape(1).astype(jnp.int32)


def whole(s_: jax.Array, j: jax.Array, slots: Ref, n_ref: Ref) -> tuple[jax.Array, ...]:
    """The index map of an operand every grid step sees whole (x, the routing, y)."""
    return jnp.int32(0), jnp.int32(0)


# A window of one weight operand: (expert e, F block j) -> the ref view to copy.
Window = Callable[[jax.Array, jax.Array], Ref]


class Copy(Protocol):
    """What `pltpu.make_async_copy` returns (its class is not exported)."""

    def start(self) -> None: ...

    def wait(self) -> None: ...


class WeightStream:
    """The kernel's own DMAs of expert weight blocks from HBM into VMEM, double-buffered over
    the (slot s, F block j) grid's active steps (step = s * J + j < n_active * J).

    The weights are `pltpu.HBM` operands: XLA cannot stage a whole [E, ...] weight (or a
    whole local shard of it) in VMEM ahead of the kernel, which it may do for a BlockSpec'd
    operand that fits and which reads every expert, active or not. Each window names the
    block of expert slots[s] that step (s, j) needs; step i's blocks land in buffer i % 2.
    The first active step starts its own copies; every active step starts the next step's
    copies into the other buffer before it waits for its own, so the next block streams in
    while this one multiplies. Steps past the active count copy nothing."""

    def __init__(
        self,
        slots_ref: Ref,
        n_ref: Ref,
        num_f: int,
        windows: Sequence[tuple[Window, Ref]],
        sems: Ref,
    ):
        self.slots_ref, self.n_ref, self.num_f = slots_ref, n_ref, num_f
        self.windows, self.sems = windows, sems

    def _copies(self, step: jax.Array, buf: jax.Array) -> list[Copy]:
        e = self.slots_ref[jax.lax.div(step, self.num_f)]
        j = jax.lax.rem(step, self.num_f)
        return [
            pltpu.make_async_copy(window(e, j), vmem.at[buf], self.sems.at[buf, c])
            for c, (window, vmem) in enumerate(self.windows)
        ]

    def advance(self, si: jax.Array, j: jax.Array) -> jax.Array:
        """At grid step (si, j): start what is due, wait for this step's blocks if it is
        active, and return the buffer (0 or 1) they are in."""
        step = si * self.num_f + j
        total = self.n_ref[0] * self.num_f
        buf = jax.lax.rem(step, 2)

        @pl.when((step == 0) & (total > 0))
        def _() -> None:
            for copy in self._copies(step, buf):
                copy.start()

        @pl.when(step + 1 < total)
        def _() -> None:
            for copy in self._copies(step + 1, 1 - buf):
                copy.start()

        @pl.when(step < total)
        def _() -> None:
            for copy in self._copies(step, buf):
                copy.wait()

        return buf


def gate_up_windows(w_gate_up: Ref, f: int, tf: int) -> tuple[Window, Window]:
    """Expert e's gate block j (columns j of [gate | up]) and up block j (columns F/tf + j)."""

    def gate(e: jax.Array, j: jax.Array) -> Ref:
        return w_gate_up.at[e, :, pl.ds(pl.multiple_of(j * tf, tf), tf)]

    def up(e: jax.Array, j: jax.Array) -> Ref:
        return w_gate_up.at[e, :, pl.ds(pl.multiple_of(f + j * tf, tf), tf)]

    return gate, up


def down_window(w_down: Ref, tf: int) -> Window:
    """Expert e's down block j (rows j of [F, D])."""

    def down(e: jax.Array, j: jax.Array) -> Ref:
        return w_down.at[e, pl.ds(pl.multiple_of(j * tf, tf), tf), :]

    return down


# A weight operand the kernel reads through its own DMAs (`WeightStream`): a raw HBM ref in the
# kernel, and (`in_hbm`) an array XLA must place in HBM.
HBM_SPEC = pl.BlockSpec(memory_space=pltpu.HBM)


def in_hbm(w: jax.Array) -> jax.Array:
    """w, constrained to HBM as a pallas_call operand. Without it XLA:TPU's memory-space
    assignment may stage the whole array in VMEM before the kernel when it fits (a local
    shard of a small model's experts does), copying the inactive experts as well."""
    return pltpu.with_memory_space_constraint(w, pltpu.HBM)


def fused_moe(
    x_TD: jax.Array,
    ids_TK: jax.Array,
    w_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    block_f: int | None = None,
    out_dtype: DTypeLike | None = None,
    interpret: Interpret | None = None,
    chip: str | None = None,
) -> jax.Array:
    """y_TD = sum_k w_TK * (SwiGLU expert ids_TK)(x_TD), accumulated in f32, returned as
    out_dtype (default x's dtype); see the module docstring.

    x_TD is the compute dtype: weight blocks are cast to it in VMEM (f32 params are read as
    f32, never copied). ids_TK int32 in [0, E); an id outside selects nothing (its weight is
    dropped). block_f: tf (None: `default_block_f`); on TPU F must be a multiple of 128.
    interpret / chip as the gmm kernels'."""
    t, d, e, f = _check(x_TD, ids_TK, w_TK, w_gate_up, w_down)
    k = ids_TK.shape[1]
    w_item = max(jnp.dtype(w_gate_up.dtype).itemsize, jnp.dtype(w_down.dtype).itemsize)
    tf = default_block_f(d, f, w_item) if block_f is None else int(block_f)
    if tf <= 0 or f % tf or (tf % tiling_lib.LANES and tf != f):
        raise ValueError(
            f"fused_moe: block_f={block_f} must divide moe_intermediate_size F={f} and be a "
            f"multiple of {tiling_lib.LANES} (or F itself)"
        )
    chip, interpret = tiling_lib.resolve_chip(chip), resolve_interpret(interpret)
    if interpret is False and tf % tiling_lib.LANES:
        # The gate and up blocks are column blocks of [E, D, 2F]: Mosaic needs them 128 wide.
        raise ValueError(
            f"fused_moe: moe_intermediate_size F={f} is not a multiple of {tiling_lib.LANES}, "
            f"which the kernel's gate and up blocks of w_gate_up [E, D, 2F] need on TPU; use "
            f"kernels.decode_moe=loop"
        )
    slots_S, n_S = active_slots(ids_TK, e)
    s, nf = slots_S.shape[0], f // tf
    # Rows padded to the sublane tile of x's dtype; padded rows route nowhere (id -1).
    tp = round_up(t, tiling_lib.sublanes(x_TD.dtype))
    x_pD = jnp.pad(x_TD, ((0, tp - t), (0, 0)))
    ids_pK = jnp.pad(ids_TK.astype(jnp.int32), ((0, tp - t), (0, 0)), constant_values=-1)
    w_pK = jnp.pad(w_TK.astype(jnp.float32), ((0, tp - t), (0, 0)))

    in_specs = [
        pl.BlockSpec((tp, d), whole),
        pl.BlockSpec((tp, k), whole),
        pl.BlockSpec((tp, k), whole),
        HBM_SPEC,
        HBM_SPEC,
    ]
    y_dtype = jnp.dtype(out_dtype or x_TD.dtype)
    x_item, y_item = jnp.dtype(x_TD.dtype).itemsize, y_dtype.itemsize
    # Real work: every slot's blocks multiply all padded rows (at most min(E, T*K) experts).
    flops = 2 * tp * d * 2 * f * s + 2 * tp * f * d * s
    cost = pl.CostEstimate(
        flops=flops,
        transcendentals=tp * f * s,  # silu's exp
        bytes_accessed=s * 3 * d * f * w_item + tp * d * (x_item + y_item) + 2 * tp * k * 4,
    )
    needed = tiling_lib.vmem_bytes(
        [(tp, d, x_TD.dtype), (d, tf, w_gate_up.dtype), (d, tf, w_gate_up.dtype)]
        + [(tf, d, w_down.dtype), (tp, k, jnp.int32), (tp, k, jnp.float32)],
        (tp, d, y_dtype),
        (tp, d),
    )
    y_pD: jax.Array = pl.pallas_call(
        functools.partial(_kernel, num_slots=s, f=f, tf=tf),
        out_shape=ShapeDtypeStruct((tp, d), y_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(s, nf),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tp, d), whole),
            scratch_shapes=[
                pltpu.VMEM((tp, d), jnp.float32),
                pltpu.VMEM((2, d, tf), w_gate_up.dtype),
                pltpu.VMEM((2, d, tf), w_gate_up.dtype),
                pltpu.VMEM((2, tf, d), w_down.dtype),
                pltpu.SemaphoreType.DMA((2, 3)),
            ],
        ),
        compiler_params=tiling_lib.compiler_params(
            "fused_moe", DIMENSIONS, (tp, d, tf), needed, chip
        ),
        interpret=interpret,
        cost_estimate=cost,
        name="moetext_fused_moe",
    )(slots_S, n_S, x_pD, ids_pK, w_pK, in_hbm(w_gate_up), in_hbm(w_down))
    return y_pD[:t]


def _kernel(
    slots_ref: Ref,
    n_ref: Ref,
    x_ref: Ref,
    ids_ref: Ref,
    w_ref: Ref,
    w_gate_up: Ref,
    w_down: Ref,
    y_ref: Ref,
    acc_ref: Ref,
    gate_buf: Ref,
    up_buf: Ref,
    down_buf: Ref,
    sems: Ref,
    *,
    num_slots: int,
    f: int,
    tf: int,
) -> None:
    gate, up = gate_up_windows(w_gate_up, f, tf)
    windows = [(gate, gate_buf), (up, up_buf), (down_window(w_down, tf), down_buf)]
    buf = WeightStream(slots_ref, n_ref, f // tf, windows, sems).advance(
        pl.program_id(0), pl.program_id(1)
    )

    def contribution(si: jax.Array) -> jax.Array:
        x = x_ref[...]
        e = slots_ref[si]
        c_T1 = jnp.sum(
            jnp.where(ids_ref[...] == e, w_ref[...], jnp.zeros((), jnp.float32)),
            axis=1,
            keepdims=True,
        )
        g = matmul_f32(x, gate_buf[buf])
        u = matmul_f32(x, up_buf[buf])
        h = (c_T1 * (jax.nn.silu(g) * u)).astype(x.dtype)
        return matmul_f32(h, down_buf[buf])

    accumulate_slots(n_ref, acc_ref, y_ref, contribution, num_slots=num_slots, num_f=f // tf)


def matmul_f32(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with b in a's dtype, accumulated in f32 (the MXU's native accumulation)."""
    return jax.lax.dot_general(
        a, b.astype(a.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


def accumulate_slots(
    n_ref: Ref,
    acc_ref: Ref,
    y_ref: Ref,
    contribution: Callable[[jax.Array], jax.Array],
    *,
    num_slots: int,
    num_f: int,
) -> None:
    """The (slot, F block) grid's skeleton: zero the f32 accumulator at the first step, add
    `contribution(slot)` at every step of an active slot (slot < n), write y at the last step
    (program ids are read here, outside the conditional bodies, as interpret mode needs)."""
    si, j = pl.program_id(0), pl.program_id(1)

    @pl.when((si == 0) & (j == 0))
    def _() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(si < n_ref[0])
    def _() -> None:
        acc_ref[...] += contribution(si)

    @pl.when((si == num_slots - 1) & (j == num_f - 1))
    def _() -> None:
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


def _check(
    x_TD: jax.Array,
    ids_TK: jax.Array,
    w_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
) -> tuple[int, int, int, int]:
    """(T, D, E, F) of consistent operands, else a ValueError naming the mismatch."""
    shapes = (
        f"x_TD {tuple(x_TD.shape)}, ids_TK {tuple(ids_TK.shape)}, w_TK {tuple(w_TK.shape)}, "
        f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}"
    )
    if x_TD.ndim != 2 or ids_TK.ndim != 2 or w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(
            f"fused_moe: expected x_TD [T, D], ids_TK [T, K], w_gate_up [E, D, 2F], "
            f"w_down [E, F, D]; got {shapes}"
        )
    (t, d), (e, d2, f2) = x_TD.shape, w_gate_up.shape
    f = f2 // 2
    problems = []
    if ids_TK.shape[0] != t or w_TK.shape != ids_TK.shape:
        problems.append(f"ids_TK and w_TK must both be [T={t}, K]")
    if d2 != d or f2 % 2:
        problems.append(f"w_gate_up must be [E, D={d}, 2F] with an even last dim")
    if w_down.shape != (e, f, d):
        problems.append(f"w_down must be [E={e}, F={f}, D={d}]")
    if not jnp.issubdtype(ids_TK.dtype, jnp.integer):
        problems.append(f"ids_TK must be integer, got {ids_TK.dtype}")
    if problems:
        raise ValueError(f"fused_moe: {'; '.join(problems)}; got {shapes}")
    return t, d, e, f


def fused_moe_reference(
    x_TD: jax.Array,
    ids_TK: jax.Array,
    w_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    dtype: DTypeLike | None = None,
) -> jax.Array:
    """The kernel's computation in jnp (every expert, dense; tests and non-TPU fallbacks)."""
    _check(x_TD, ids_TK, w_TK, w_gate_up, w_down)
    dt = jnp.dtype(dtype or x_TD.dtype)
    e, f = w_gate_up.shape[0], w_gate_up.shape[2] // 2
    x = x_TD.astype(dt)
    gu_TEF2 = jnp.einsum("td,edf->tef", x, w_gate_up.astype(dt), preferred_element_type=jnp.float32)
    h_TEF = jax.nn.silu(gu_TEF2[..., :f]) * gu_TEF2[..., f:]
    c_TE = jnp.sum(
        jax.nn.one_hot(ids_TK, e, dtype=jnp.float32) * w_TK.astype(jnp.float32)[..., None], axis=1
    )
    h_TEF = (c_TE[..., None] * h_TEF).astype(dt)
    y = jnp.einsum("tef,efd->td", h_TEF, w_down.astype(dt), preferred_element_type=jnp.float32)
    return y.astype(dt)
