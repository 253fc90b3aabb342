"""The MoE layer for decoding: prefused gate|up weights and a decode-shaped expert path.

Legend: T tokens, K experts per token, E experts, D emb_dim, F moe_intermediate_size.

`prefuse(experts)` (once, at load) replaces w_gate and w_up [E, D, F] by w_gate_up [E, D, 2F]
(`[gate | up]` on the last axis), so a step reads the input once for both (the training layer's
`kernels.fuse_gate_up` concatenates them inside every step instead). Then per step:

- `gathered` (decode-shaped: at most E (token, expert) rows, T * K <= E, e.g. a batch of up to
  16 rows at Qwen3-30B-A3B's E = 128, K = 8; `GATHER_BELOW`): a loop over the T * K rows, each
  reading only its expert's slabs w_gate_up[e] [D, 2F] and w_down[e] [F, D]: the step touches
  K of E experts per token (for Qwen3-30B-A3B, 8 of 128), at most E slabs in all, where the
  grouped matmuls read every expert;
- `grouped` (prefill, many tokens): sort the T * K assignments by expert, one grouped matmul
  against w_gate_up, SwiGLU on its two halves, one grouped matmul against w_down. Under sharding
  rules that split the tokens or the experts over the mesh, the rows go through the training
  layer's per-shard dispatch instead (`ep.dropless`, a shard_map): XLA cannot partition a Mosaic
  kernel, so a grouped matmul over global arrays would not compile on a multi-chip TPU.

Both equal the training layer's dropless forward (tests/models/test_moe_decode.py).

`kernels.decode_moe` (stored on the experts by `prefuse`) can replace both, for calls of at most
FUSED_MAX_ROWS rows, by `fused`: one Pallas TPU kernel (kernels/pallas/moe_decode.py) that reads
each active expert's weights once and applies the combine weights itself, so it returns y_TD
where the two above return y_TKD (`routed_output` gives y_TD either way). auto takes it when the
code runs on or compiles for a TPU and the sharding rules split the expert weights along E
and/or D only (`fused_layout`); under rules it runs in shard_map (`fused_sharded`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from moetext.kernels.gmm import Gmm
from moetext.kernels.pallas import moe_decode as fused_kernel
from moetext.kernels.pallas import moe_decode_split as fused_split
from moetext.kernels.pallas import target
from moetext.models.layers.rowdot import dot_rows
from moetext.models.moe import dispatch as dsp
from moetext.models.moe import ep
from moetext.models.moe.experts import Experts

# The gathered path runs while T * K (token, expert) rows are fewer than this; None: E + 1, so
# it never reads more expert slabs than the grouped path's E. Measured (docs/performance.md,
# "Decoding"): Qwen3-30B-A3B's decode step at batch 8 (64 rows) compiled for v5e:2x4 accesses
# 5.1 GB per chip gathered vs 100.6 GB grouped (which all-gathers every expert under fsdp), with
# 0.05 vs 8.3 GB of temporaries; on CPU the two are within noise at 64 rows.
GATHER_BELOW: int | None = None
DECODE_KERNELS = ("auto", "fused", "loop")  # kernels.decode_moe
# Calls with more rows (prefill) take the grouped matmuls: the fused kernel multiplies every row
# by every active expert, which pays while the bytes of the weights dominate, not for prompts.
FUSED_MAX_ROWS = 256


def prefuse(experts: Experts, kernel: str = "auto") -> None:
    """w_gate, w_up -> w_gate_up [E, D, 2F] in place (same logical axes; w_gate and w_up are
    deleted, so the layer then only decodes); `kernel` (kernels.decode_moe) is kept as the
    experts' decode kernel."""
    if kernel not in DECODE_KERNELS:
        raise ValueError(
            f"unknown kernels.decode_moe {kernel!r}; valid: {', '.join(DECODE_KERNELS)}"
        )
    experts.decode_kernel = kernel
    if hasattr(experts, "w_gate_up"):
        return
    fused = jnp.concatenate([experts.w_gate[...], experts.w_up[...]], axis=2)
    names = ("exp", "embed", "mlp_moe")
    experts.w_gate_up = nnx.Param(fused, out_sharding=names, eager_sharding=False)
    del experts.w_gate
    del experts.w_up


def prefuse_all(model: nnx.Module, kernel: str = "auto") -> int:
    """Prefuses every Experts module of `model` (decode kernel `kernel`, kernels.decode_moe);
    returns how many (the model then decodes)."""
    found = [node for _, node in nnx.iter_graph(model) if isinstance(node, Experts)]
    for experts in found:
        prefuse(experts, kernel)
    return len(found)


def is_prefused(experts: Experts) -> bool:
    return hasattr(experts, "w_gate_up")


def gathered(
    x_TD: jax.Array, ids_TK: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, dtype: DTypeLike
) -> jax.Array:
    """y_TKD: each (token, expert) pair in turn, reading only that expert's weights.

    One loop iteration per pair slices w_gate_up[e] and w_down[e] and multiplies the token's
    row by them (`dot_rows`); nothing the size of T * K experts is ever materialised. (A gather
    w_gate_up[ids] first copies [T, K, D, 2F] and then reads the copy: on CPU that copy cost
    more than the matmuls, docs/performance.md "Decoding".)"""
    t, k = ids_TK.shape
    x = x_TD.astype(dtype)
    ids_M = ids_TK.reshape(t * k)
    f = w_gate_up.shape[-1] // 2

    def pair(m: jax.Array, y_MD: jax.Array) -> jax.Array:
        e = ids_M[m]
        x_1D = jax.lax.dynamic_slice_in_dim(x, m // k, 1)
        w_gu_DF2 = jax.lax.dynamic_index_in_dim(w_gate_up, e, keepdims=False)
        gu_1F2 = dot_rows(x_1D, w_gu_DF2, w_contract=0, dtype=dtype, out_dtype=dtype)
        h_1F = jax.nn.silu(gu_1F2[:, :f]) * gu_1F2[:, f:]
        w_down_FD = jax.lax.dynamic_index_in_dim(w_down, e, keepdims=False)
        y_1D = dot_rows(h_1F, w_down_FD, w_contract=0, dtype=dtype, out_dtype=dtype)
        return jax.lax.dynamic_update_slice_in_dim(y_MD, y_1D, m, axis=0)

    y_MD: jax.Array = jax.lax.fori_loop(0, t * k, pair, jnp.zeros((t * k, x.shape[1]), dtype))
    return y_MD.reshape(t, k, -1)


def grouped(
    x_TD: jax.Array,
    ids_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    gmm: Gmm,
    dtype: DTypeLike,
) -> jax.Array:
    """y_TKD through grouped matmuls: [gate | up] in one, then down."""
    e = w_gate_up.shape[0]
    xs_MD, group_sizes_E, order_M = dsp.permute(x_TD.astype(dtype), ids_TK, e)
    gu_MF2 = gmm(
        xs_MD,
        w_gate_up.astype(dtype),
        group_sizes_E,
        preferred_element_type=dtype,
        rows_covered=True,
    )
    f = gu_MF2.shape[-1] // 2
    h_MF = jax.nn.silu(gu_MF2[:, :f]) * gu_MF2[:, f:]
    ys_MD = gmm(
        h_MF, w_down.astype(dtype), group_sizes_E, preferred_element_type=dtype, rows_covered=True
    )
    return dsp.unpermute(ys_MD, order_M, ids_TK.shape[1])


def routed_output(
    experts: Experts,
    x_TD: jax.Array,
    ids_TK: jax.Array,
    weights_TK: jax.Array,
    gmm: Gmm,
    dtype: DTypeLike,
) -> jax.Array:
    """y_TD = sum_k weights_TK * expert ids_TK (x_TD) of a prefused layer, in `dtype`: the fused
    kernel where the experts' decode kernel picks it (`use_fused`), else `expert_outputs`
    combined."""
    kernel, (e, _, f2) = getattr(experts, "decode_kernel", "loop"), experts.w_gate_up.shape
    if use_fused(kernel, x_TD.shape[0], e, f2 // 2):
        return fused(x_TD, ids_TK, weights_TK, experts, dtype)
    y_TKD = expert_outputs(experts, x_TD, ids_TK, gmm, dtype)
    return dsp.combine(y_TKD, weights_TK, dtype)


def use_fused(kernel: str, rows: int, num_experts: int, f: int) -> bool:
    """Whether a decode call of `rows` rows runs the fused kernel (see kernels.decode_moe) on
    experts of width F = f (auto: on TPU only for F a multiple of 128, as Mosaic needs)."""
    if kernel == "loop" or rows > FUSED_MAX_ROWS:
        return False
    if kernel == "fused":
        return True
    if not target.tpu_code() or f % 128:
        return False
    return fused_layout(ep.layout_from_context(num_experts)) is None


def fused_layout(layout: ep.EPLayout | None) -> str | None:
    """None when the fused kernel can run under `layout` (no rules, or rules that split the
    expert weights along E and/or D only, D on the same axes in both), else why not."""
    if layout is None:
        return None
    split = {
        (name, dim): axes
        for name, spec in (("in", layout.w_in_spec), ("out", layout.w_out_spec))
        for dim, axes in ep.weight_gather(spec)
        if _size(layout, axes) > 1
    }
    d_in, d_out = split.pop(("in", 1), ()), split.pop(("out", 2), ())
    if not split and d_in == d_out:
        return None
    return (
        f"the sharding rules split the expert weights along F (mlp_moe) or D differently in "
        f"w_gate_up {layout.w_in_spec} and w_down {layout.w_out_spec} (mesh "
        f"{dict(layout.mesh.shape)}); the fused decode kernel takes experts split along E and "
        f"D (embed) only: use fsdp or fsdp_ep, or kernels.decode_moe=loop"
    )


def _size(layout: ep.EPLayout, axes: tuple[str, ...]) -> int:
    return math.prod(layout.mesh.shape[a] for a in axes)


def _d_axes(layout: ep.EPLayout) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split D of the expert weights."""
    axes = dict(ep.weight_gather(layout.w_in_spec)).get(1, ())
    return axes if _size(layout, axes) > 1 else ()


def fused(
    x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array, experts: Experts, dtype: DTypeLike
) -> jax.Array:
    """y_TD through the fused kernel; under sharding rules in shard_map (`fused_sharded`)."""
    x = x_TD.astype(dtype)
    w_gu, w_down = experts.w_gate_up[...], experts.w_down[...]
    layout = ep.layout_from_context(w_gu.shape[0])
    why = fused_layout(layout)
    if why is not None:
        raise ValueError(f"kernels.decode_moe=fused: {why}")
    if layout is None:
        return fused_kernel.fused_moe(x, ids_TK, weights_TK, w_gu, w_down)
    return fused_sharded(layout, x, ids_TK, weights_TK, w_gu, w_down)


def fused_sharded(
    layout: ep.EPLayout,
    x_TD: jax.Array,
    ids_TK: jax.Array,
    weights_TK: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """The fused kernel in shard_map. Tokens are split over the token axes that split neither
    the experts nor D (padded with rows routed nowhere). Each expert shard runs its L = E/P
    local experts on all of its tokens (global ids shifted by shard * L; other experts' ids fall
    outside [0, L) and select nothing); partial outputs (f32) are summed over the expert axes.
    With D split (fsdp), each shard holds [D / P_d] of every expert: the gate|up partial
    products of the active slots are summed over the D axes before the SiLU (`fused_gate_up`,
    psum [S, t, 2F] f32), then `fused_down` gives the shard's [t, D / P_d] columns of y."""
    exp_axes, d_axes = layout.exp_axes, _d_axes(layout)
    tok_axes = tuple(a for a in layout.token_axes if a not in exp_axes + d_axes)
    shards = _size(layout, tok_axes)
    t, n_local = x_TD.shape[0], w_gate_up.shape[0] // layout.num_shards
    pad = -t % shards
    if pad:
        x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
        ids_TK = jnp.pad(ids_TK, ((0, pad), (0, 0)), constant_values=-1)
        weights_TK = jnp.pad(weights_TK, ((0, pad), (0, 0)))
    tok = PartitionSpec(tok_axes or None)  # type: ignore[no-untyped-call]  # jax: PartitionSpec.__new__ unannotated
    out = PartitionSpec(tok_axes or None, d_axes or None)  # type: ignore[no-untyped-call]  # jax: PartitionSpec.__new__ unannotated

    def body(
        x: jax.Array, ids: jax.Array, w: jax.Array, w_gu: jax.Array, w_dn: jax.Array
    ) -> jax.Array:
        if exp_axes:
            ids = ids - jax.lax.axis_index(exp_axes) * n_local
        if not d_axes:
            y = fused_kernel.fused_moe(x, ids, w, w_gu, w_dn, out_dtype=jnp.float32)
        else:
            y = _d_split(x, ids, w, w_gu, w_dn, d_axes)
        if exp_axes:
            y = jax.lax.psum(y, exp_axes)  # type: ignore[no-untyped-call]  # jax: unannotated
        return y.astype(x.dtype)

    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(tok, tok, tok, layout.w_in_spec, layout.w_out_spec),
        out_specs=out,
        check_vma=False,  # as in ep.dropless: the specs state the replication exactly
    )
    y_TD: jax.Array = fn(x_TD, ids_TK, weights_TK, w_gate_up, w_down)
    return y_TD[:t]


def _d_split(
    x_tD: jax.Array,
    ids_tK: jax.Array,
    w_tK: jax.Array,
    w_gu: jax.Array,
    w_dn: jax.Array,
    d_axes: tuple[str, ...],
) -> jax.Array:
    """One shard's [t, D / P_d] columns of y (f32) from its D slices of the expert weights."""
    slots_S, n_S = fused_kernel.active_slots(ids_tK, w_gu.shape[0])
    d_idx = jax.lax.axis_index(d_axes)
    x_slice = jax.lax.dynamic_slice_in_dim(x_tD, d_idx * w_gu.shape[1], w_gu.shape[1], axis=1)
    g, u = fused_split.fused_gate_up(x_slice, slots_S, n_S, w_gu)
    g, u = jax.lax.psum((g, u), d_axes)  # type: ignore[no-untyped-call]  # jax: unannotated
    c_ST = fused_split.slot_weights(ids_tK, w_tK, slots_S, n_S)
    h = (c_ST[..., None] * jax.nn.silu(g) * u).astype(x_tD.dtype)
    return fused_split.fused_down(h, slots_S, n_S, w_dn)


def expert_outputs(
    experts: Experts, x_TD: jax.Array, ids_TK: jax.Array, gmm: Gmm, dtype: DTypeLike
) -> jax.Array:
    """y_TKD of a prefused layer: gathered for few rows, grouped for many (static shapes)."""
    w_gu, w_down = experts.w_gate_up[...], experts.w_down[...]
    below = w_gu.shape[0] + 1 if GATHER_BELOW is None else GATHER_BELOW
    if ids_TK.size < below:
        return gathered(x_TD, ids_TK, w_gu, w_down, dtype)
    layout = ep.layout_from_context(w_gu.shape[0])
    if layout is None:
        return grouped(x_TD, ids_TK, w_gu, w_down, gmm, dtype)
    return sharded(layout, x_TD, ids_TK, experts, gmm)


def sharded(
    layout: ep.EPLayout, x_TD: jax.Array, ids_TK: jax.Array, experts: Experts, gmm: Gmm
) -> jax.Array:
    """y_TKD through the per-shard dispatch of `layout` (`ep.dropless`; gate and up are the
    halves of w_gate_up). T is padded to a multiple of the token shards with rows of expert 0
    (a prompt of any length, a batch of any size), whose outputs are dropped."""
    t = x_TD.shape[0]
    pad = -t % layout.token_shards
    if pad:
        x_TD = jnp.pad(x_TD, ((0, pad), (0, 0)))
        ids_TK = jnp.pad(ids_TK, ((0, pad), (0, 0)))
    return ep.dropless(layout, x_TD, ids_TK, experts, gmm)[0][:t]  # dropless: drops nothing
