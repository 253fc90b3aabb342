"""Expert parallelism (EP): the dropless dispatch in `jax.shard_map`, tokens moved by all-to-all.

Legend: T tokens (global), t local tokens, K experts per token, m = t*K local assignment rows,
D emb_dim, F moe_intermediate_size, E experts, P expert-parallel shards, L = E/P experts per
shard, R rows received by a shard, C rows per destination in the padded (CPU) exchange.

The sharded dispatch turns on by itself whenever a rules context (`logical.use_rules`) is
active and either splits the tokens (logical "batch"/"length") over mesh axes of total size > 1
or maps "exp" to mesh axes of total size P > 1. Without it XLA would have to run the dispatch's
argsort over the global batch, which it cannot partition: every chip would hold every chip's
routed rows (the all-reduced [T*K, D] arrays of docs/performance.md). Per shard:

    permute local rows by global expert id -> exchange per-expert counts (all_gather over the
    exp axes) -> rows to the shard owning their expert (all-to-all; their routing weights,
    when given, by a second all-to-all of [m, 1]) -> sort received rows by local expert -> the
    SwiGLU's gmm calls (three; two under fuse_gate_up) with group_offset = shard * L, the
    weights scaling each row before the down gmm -> unsort -> rows back (reverse
    all-to-all) -> unpermute -> y_TKD, or, given the routing weights, y_TD: the weighted rows
    added up per token (`dispatch.unpermute_sum`)

P = 1 (presets fsdp, fsdp_tp: tokens sharded, experts not) is the degenerate case: no counts
exchange and no all-to-all; each shard sorts its own t*K rows and runs gmm against all E experts
(each weight slice all-gathered inside gmm along `weight_gather`, as FSDP does for a dense MLP;
FP8 on the wire under fp8_blockwise's qag).

On a 3D TPU slice the shard_map's mesh is the run's mesh with each weight-gather axis that spans
three torus dims split in two (`_split`, sharding/torus.py): same devices, same shards, but the
gradients' reduce-scatters run per sub-axis, which XLA:TPU keeps as real reduce-scatters instead
of all-reduces. The weights' all-gathers run per sub-axis only on the slices that need it for
them too (v5p:4x4x4 and larger); elsewhere each is one all-gather over the pair.

Shard p owns experts [p*L, (p+1)*L): the weights are split along E on the exp axes, so their
dim-0 block p is exactly those experts. Routing and the aux losses stay outside, on the global
token view, so they equal the single-device values by construction.

The exchange (`ep_exchange.py`) is picked by the mesh's platform: `ragged_all_to_all` on TPU,
fixed per-destination buffers and a plain all-to-all elsewhere. Both take at most R rows per
receiving shard (`moe.ep_buffer_factor`; by default the worst case, nothing dropped) and drop
the same rows past it; `dropless` reports the fraction of assignments dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jax.typing import DTypeLike

from moetext.kernels import gmm as gmm_lib
from moetext.kernels.gmm import Gmm
from moetext.models.moe import dispatch as dsp
from moetext.models.moe import ep_exchange as ex_lib
from moetext.models.moe.experts import Experts, MatMul, swiglu_mlp
from moetext.sharding import logical, torus

# Logical names of the expert weights (models/moe/experts.py creates them with these).
W_IN_NAMES = ("exp", "embed", "mlp_moe")  # w_gate, w_up [E, D, F]
W_OUT_NAMES = ("exp", "mlp_moe", "embed")  # w_down [E, F, D]
TOKEN_NAMES = ("batch", "length")

# What runs per shard inside shard_map: (x_tD, ids_tK, w_gate, w_up, w_down, weights_tK or
# None) -> (y_tKD, or y_tD when combined by weights_tK; float32 [1]: rows this shard dropped).
ShardBody = Callable[
    [jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None],
    tuple[jax.Array, jax.Array],
]


@dataclasses.dataclass(frozen=True)
class EPLayout:
    """Where things live for one EP dispatch (all static, read from the rules at trace time)."""

    mesh: Mesh
    exp_axes: tuple[str, ...]  # mesh axes that split E (shard index = axis_index over them)
    num_shards: int  # P
    token_axes: tuple[str, ...]  # mesh axes that split T inside the shard_map
    w_in_spec: PartitionSpec
    w_out_spec: PartitionSpec
    exchange: str  # "ragged" | "padded" | "none" (P = 1)
    # All-gather each weight dim's (split) mesh axes in one collective (`_split`).
    gather_jointly: bool = False

    @property
    def token_shards(self) -> int:
        """How many shards split the tokens (the product of the token axes' sizes)."""
        return _size(self.mesh, self.token_axes)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def exchange_for(mesh: Mesh) -> str:
    """ "ragged" where XLA has ragged-all-to-all (TPU), "padded" elsewhere."""
    return "ragged" if mesh.devices.flat[0].platform == "tpu" else "padded"


def layout_from_context(num_experts: int) -> EPLayout | None:
    """The sharded-dispatch layout of the active rules, or None for the single-shard path (no
    rules, or neither tokens nor experts split over mesh axes of size > 1)."""
    ctx = logical.current()
    if ctx is None:
        return None
    mesh, rules = ctx
    names = mesh.axis_names
    w_in = logical.logical_to_mesh_spec(W_IN_NAMES, rules, names)
    w_out = logical.logical_to_mesh_spec(W_OUT_NAMES, rules, names)
    exp_axes = logical.as_axes(w_in[0])
    p = _size(mesh, exp_axes)
    tok = logical.logical_to_mesh_spec(TOKEN_NAMES, rules, names)
    token_axes = logical.as_axes(tok[0]) + logical.as_axes(tok[1])
    if p <= 1:
        if _size(mesh, token_axes) <= 1:
            return None
        # Experts replicated (up to size-1 axes): per-shard sort, no exchange.
        return _split(EPLayout(mesh, (), 1, token_axes, w_in, w_out, "none"))
    if num_experts % p:
        raise ValueError(
            f"expert parallelism: num_experts={num_experts} is not divisible by the {p} shards "
            f"of mesh axes {exp_axes} (mesh {dict(mesh.shape)}); pick an expert axis size that "
            f"divides {num_experts}"
        )
    # Tokens must be split over the exp axes too (each shard dispatches its own rows); if the
    # rules replicate them there, split them anyway: shard_map slices, nothing is lost.
    token_axes += tuple(a for a in exp_axes if a not in token_axes)
    return _split(EPLayout(mesh, exp_axes, p, token_axes, w_in, w_out, exchange_for(mesh)))


def _split(layout: EPLayout) -> EPLayout:
    """The layout on a mesh whose weight-gather axes span at most two torus dims each
    (sharding/torus.py): on a 3D TPU slice the weights' gathers and their gradients'
    reduce-scatters run per sub-axis and stay real all-gathers / reduce-scatters instead of
    all-reduces. The same devices hold the same shards; elsewhere the layout is unchanged."""
    gathered = [
        a
        for spec in (layout.w_in_spec, layout.w_out_spec)
        for _, ax in weight_gather(spec)
        for a in ax
    ]
    mesh, renames = torus.split_for_collectives(
        layout.mesh, [a for a in gathered if a not in layout.exp_axes]
    )
    if not renames:
        return layout
    # The split is for the gradients' reduce-scatters; where the whole gather of each weight
    # dim stays an all-gather (all but the largest 3D slices), gathering it in one collective
    # spares the half-gathered weight's round trip through HBM.
    jointly = all(
        torus.gathers_whole(layout.mesh, ax)
        for spec in (layout.w_in_spec, layout.w_out_spec)
        for _, ax in weight_gather(spec)
    )
    return dataclasses.replace(
        layout,
        gather_jointly=jointly,
        mesh=mesh,
        token_axes=torus.rename_axes(layout.token_axes, renames),
        w_in_spec=torus.rename_spec(layout.w_in_spec, renames),
        w_out_spec=torus.rename_spec(layout.w_out_spec, renames),
    )


def weight_gather(spec: PartitionSpec) -> gmm_lib.Gather:
    """The (dim, mesh axes) pairs along which a local expert-weight slice is split besides the
    experts (e.g. fsdp on D), read from the weight's PartitionSpec, i.e. from the rules.

    Dim 0 (experts) stays split: that is expert parallelism. gmm all-gathers the slice along
    these (FP8 under QAG) and reduce-scatters its gradient back.
    """
    return tuple(
        (dim, logical.as_axes(spec[dim]))
        for dim in range(1, len(spec))
        if logical.as_axes(spec[dim])
    )


def dropless(
    layout: EPLayout,
    x_TD: jax.Array,
    ids_TK: jax.Array,
    experts: Experts,
    gmm: Gmm,
    weights_TK: jax.Array | None = None,
    buffer_factor: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """(y, dropped): y_TKD = expert_{ids[t, k]}(x_t) for every assignment, tokens split over
    the token axes and experts over the exp axes (none when P = 1); given weights_TK, their
    combination y_TD = sum_k weights[t, k] * y_TKD[t, k] in the experts' dtype, formed inside
    each shard: the weights scale each row in the SwiGLU, before the down projection (for P > 1
    they cross to the row's expert shard with it, one [m, 1] exchange), and
    `dispatch.unpermute_sum` adds the rows up (its backward keeps nothing of them).

    buffer_factor > 0 bounds each shard's receive buffer to that many times its own rows (the
    module docstring); the assignments past it come out 0. dropped: the float32 fraction of
    the T*K assignments dropped (0 when buffer_factor is 0 or P = 1).

    `experts` is the block's `Experts` module (stacked global weights [E, D, F] / [E, F, D]);
    `gmm` the block's grouped matmul.
    """
    if buffer_factor < 0:
        raise ValueError(f"EP buffer_factor must be >= 0 (0: the worst case), got {buffer_factor}")
    t, k = ids_TK.shape
    shards = layout.token_shards
    if t % shards:
        raise ValueError(
            f"sharded MoE dispatch: {t} tokens (batch x length) do not split over the {shards} "
            f"shards of mesh axes {layout.token_axes} (mesh {dict(layout.mesh.shape)}); make "
            f"the global batch a multiple of {shards}"
        )
    tok = PartitionSpec(layout.token_axes)  # type: ignore[no-untyped-call]  # jax: PartitionSpec.__new__ unannotated
    w_gate, w_up = experts.gate_up()
    if layout.num_shards == 1:
        body = _local_body(layout, w_gate.shape[0], experts.dtype, gmm)
    else:
        body = _shard_body(layout, w_gate.shape[0], experts.dtype, gmm, buffer_factor)
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(tok, tok, layout.w_in_spec, layout.w_in_spec, layout.w_out_spec, tok),
        # y, and each token shard's count of dropped rows (one element per shard).
        out_specs=(tok, tok),
        # The gmm backends build loop carries from fresh zeros (no varying-mesh-axis type), which
        # the vma checker rejects; the specs above state the replication exactly instead.
        check_vma=False,
    )
    y, dropped_S = fn(x_TD, ids_TK, w_gate, w_up, experts.w_down[...], weights_TK)
    return y, jnp.sum(dropped_S) / (t * k)


def _back_to_tokens(
    ys_mD: jax.Array, order_m: jax.Array, k: int, weighted: bool, dtype: DTypeLike
) -> jax.Array:
    """Sorted rows back in token order: y_tKD, or (rows already scaled by their routing
    weights) their sum over K, y_tD."""
    if weighted:
        return dsp.unpermute_sum(ys_mD, order_m, k, dtype)
    return dsp.unpermute(ys_mD, order_m, k)


def _local_body(layout: EPLayout, num_experts: int, dtype: DTypeLike, gmm: Gmm) -> ShardBody:
    """P = 1: this shard's rows through all E experts; the only collectives are the weights'
    all-gathers (and, in the backward pass, their reduce-scatters)."""

    def body(
        x_tD: jax.Array,
        ids_tK: jax.Array,
        w_gate: jax.Array,
        w_up: jax.Array,
        w_down: jax.Array,
        weights_tK: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        xs_mD, sizes_E, order_m = dsp.permute(x_tD.astype(dtype), ids_tK, num_experts)
        k = ids_tK.shape[1]
        # The routing weights scale the rows before the down projection (dsp.unpermute_sum).
        w_m = None if weights_tK is None else dsp.routing_weights_sorted(weights_tK, order_m)
        ys_mD = _swiglu(layout, xs_mD, (w_gate, w_up, w_down), sizes_E, None, gmm, dtype, w_m)
        y = _back_to_tokens(ys_mD, order_m, k, weights_tK is not None, dtype)
        return y, jnp.zeros((1,), jnp.float32)

    return body


def _shard_body(
    layout: EPLayout, num_experts: int, dtype: DTypeLike, gmm: Gmm, buffer_factor: float
) -> ShardBody:
    p, axes = layout.num_shards, layout.exp_axes
    n_local = num_experts // p

    def body(
        x_tD: jax.Array,
        ids_tK: jax.Array,
        w_gate: jax.Array,
        w_up: jax.Array,
        w_down: jax.Array,
        weights_tK: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        me = jax.lax.axis_index(axes)
        k = ids_tK.shape[1]
        xs_mD, sizes_E, order_m = dsp.permute(x_tD.astype(dtype), ids_tK, num_experts)
        # sizes_PE[i, e]: rows shard i sends to expert e; every shard derives all offsets from it.
        sizes_PE = jax.lax.all_gather(sizes_E, axes, axis=0, tiled=False)
        m = xs_mD.shape[0]
        counts = ex_lib.Counts(sizes_PE, p, n_local, ex_lib.recv_rows(m, p, buffer_factor))
        ex = ex_lib.EXCHANGES[layout.exchange](axes, p, me, counts, m)
        recv_RD, local_R = ex.forward(xs_mD)
        # Received rows come source-major; gmm needs them grouped by expert (stable: padding,
        # key n_local, sorts last, past sum(group_sizes), where gmm writes zeros).
        sort_R = jnp.argsort(local_R, stable=True).astype(jnp.int32)
        scale_R = None
        if weights_tK is not None:
            # The routing weights travel with their rows (one more exchange, of [m, 1] float32)
            # and scale them before the down gmm, as for P = 1; padding rows receive weight 0.
            w_m1 = dsp.routing_weights_sorted(weights_tK, order_m)[:, None]
            scale_R = dsp.rows(ex.forward(w_m1)[0][:, 0], sort_R, unique=True)
        mine_E = (jnp.arange(num_experts) // n_local) == me
        group_sizes_E = jnp.where(mine_E, jnp.sum(counts.kept_PE, axis=0), 0).astype(jnp.int32)
        ys_RD = _swiglu(
            layout,
            dsp.rows(recv_RD, sort_R, unique=True),
            (w_gate, w_up, w_down),
            group_sizes_E,
            me * n_local,
            gmm,
            dtype,
            scale_R,
        )
        unsort_R = (
            jnp.zeros_like(sort_R).at[sort_R].set(jnp.arange(sort_R.shape[0], dtype=jnp.int32))
        )
        ys_mD = ex.backward(dsp.rows(ys_RD, unsort_R, unique=True))
        y = _back_to_tokens(ys_mD, order_m, k, weights_tK is not None, dtype)
        return y, counts.dropped(me).astype(jnp.float32)[None]

    return body


def _swiglu(
    layout: EPLayout,
    xs_RD: jax.Array,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    group_sizes_E: jax.Array,
    group_offset: jax.Array | None,
    gmm: Gmm,
    dtype: DTypeLike,
    row_scale: jax.Array | None = None,
) -> jax.Array:
    """The local experts' SwiGLU on rows grouped by expert; rows of other experts come out 0.

    weights: this shard's slices (w_gate, w_up, w_down) in the parameter dtype; gmm gathers
    them along `weight_gather` in the compute dtype (or as FP8 under fp8_blockwise's qag).
    row_scale: as in `swiglu_mlp`.
    """

    def mm(spec: PartitionSpec) -> MatMul:
        def run(lhs: jax.Array, w: jax.Array) -> jax.Array:
            return gmm(
                lhs,
                w,
                group_sizes_E,
                preferred_element_type=dtype,
                group_offset=group_offset,
                rhs_gather=weight_gather(spec),
                gather_jointly=layout.gather_jointly,
                # P = 1 (no offset): all M sorted rows belong to the local experts.
                rows_covered=group_offset is None,
            )

        return run

    w_in = layout.w_in_spec
    f_axes = dict(weight_gather(w_in)).get(2, ())
    slices = math.prod(jax.lax.axis_size(a) for a in f_axes)
    w_gate, w_up, w_down = weights
    return swiglu_mlp(
        xs_RD,
        w_gate,
        w_up,
        w_down,
        mm(w_in),
        mm(layout.w_out_spec),
        gmm=gmm,
        gate_up_slices=slices,
        row_scale=row_scale,
    )
