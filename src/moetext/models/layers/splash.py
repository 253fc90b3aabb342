"""Causal GQA self-attention through Pallas splash attention (jax.experimental's TPU kernel).

Legend: B batch, S positions (queries and keys: self-attention only), N query heads, K kv heads,
H head_dim of q and k, V v's head dim; b, n the per-shard B and N inside the shard_map.

`splash_attend` computes what `models/layers/attention.py: attend` does for self-attention with
segment ids, flash-style: score blocks live in VMEM only (nothing [.., S, S] reaches HBM), blocks
above the causal diagonal are skipped, and the backward pass recomputes scores from the saved
log-sum-exp. Under a `sharding.logical.use_rules` context the kernel runs per shard in a
shard_map, the batch split as the rules split "batch" and the heads as they split "heads" (the
kernel's block layout is per device). `unfit_reason` says why a call cannot take this path
(the caller then keeps XLA's).

Segment 0 (padding). The XLA path hides keys of segment 0 from every query; splash only matches
a query's segment to a key's. A query of a real segment (id != 0) sees the same keys both ways;
a padding query sees the padding keys before it here, and nothing (a uniform average) there:
its output is junk either way, and the loss masks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sak
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sam
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from moetext.kernels.pallas import common
from moetext.sharding import logical

# Splash tile edge (queries and keys, forward and both backward kernels); MaxText's default.
# A sequence shorter than it, or not a multiple of it, takes the largest of BLOCKS dividing it.
BLOCK = 512
BLOCKS = (512, 256, 128)
# Logical axes of q and of k / v in `attend`'s layout.
Q_NAMES = ("batch", "length", "heads", "head_dim")
KV_NAMES = ("batch", "length", "kv_heads", "head_dim")


def block_size(s: int) -> int | None:
    """The tile edge for S positions: the largest of BLOCKS (at most BLOCK) dividing S."""
    return next((b for b in BLOCKS if b <= BLOCK and s % b == 0), None)


def _specs(
    q_BSNH: jax.Array, k_BSKH: jax.Array
) -> tuple[jax.sharding.Mesh, PartitionSpec, PartitionSpec, PartitionSpec] | str | None:
    """(mesh, q spec, k/v spec, segment-id spec) of the shard_map under the active rules; None
    without rules; a reason string when the shapes do not split evenly."""
    active = logical.current()
    if active is None:
        return None
    mesh, rules = active
    q_spec = logical.logical_to_mesh_spec(Q_NAMES, rules, mesh.axis_names)
    kv_spec = logical.logical_to_mesh_spec(KV_NAMES, rules, mesh.axis_names)
    batch, heads, kv_heads = q_spec[0], q_spec[2], kv_spec[2]
    if logical.as_axes(heads) != logical.as_axes(kv_heads):
        # GQA per shard needs each shard's query heads to own their kv heads: split both the
        # same way or neither.
        heads = kv_heads = None
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))

    def ways(axes: logical.MeshAxes) -> int:
        return math.prod(sizes[a] for a in logical.as_axes(axes))

    b, n, kv = q_BSNH.shape[0], q_BSNH.shape[2], k_BSKH.shape[2]
    if b % ways(batch) or n % ways(heads) or kv % ways(heads):
        return (
            f"batch {b}, heads {n} and kv heads {kv} must split evenly over mesh axes "
            f"{logical.as_axes(batch)} (batch) and {logical.as_axes(heads)} (heads)"
        )
    q = PartitionSpec(batch, None, heads, None)  # type: ignore[no-untyped-call]
    k = PartitionSpec(batch, None, kv_heads, None)  # type: ignore[no-untyped-call]
    seg = PartitionSpec(batch, None)  # type: ignore[no-untyped-call]
    return mesh, q, k, seg


def unfit_reason(q_BSNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> str | None:
    """Why splash cannot run this self-attention call (None: it can)."""
    s, t = q_BSNH.shape[1], k_BTKH.shape[1]
    if s != t:
        return f"queries ({s}) and keys ({t}) differ: splash here is self-attention only"
    if block_size(s) is None:
        return f"sequence length {s} is not a multiple of {BLOCKS[-1]}"
    if v_BTKH.shape[:3] != k_BTKH.shape[:3]:
        return f"v {v_BTKH.shape} and k {k_BTKH.shape} differ before the head dim"
    specs = _specs(q_BSNH, k_BTKH)
    return specs if isinstance(specs, str) else None


def splash_attend(
    q_BSNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKV: jax.Array,
    segment_ids_BS: jax.Array | None = None,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal GQA softmax(q k^T * scale) v of `attend`'s self-attention; returns [B, S, N, V] in
    v's dtype. scale defaults to 1 / sqrt(H). interpret: None compiles with Mosaic on (or for)
    TPU and interprets elsewhere (`common.resolve_interpret`). Check `unfit_reason` first."""
    reason = unfit_reason(q_BSNH, k_BSKH, v_BSKV)
    if reason is not None:
        raise ValueError(f"splash attention cannot run this call: {reason}")
    h = q_BSNH.shape[-1]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    # Splash takes q pre-scaled; scaling in f32 rounds once, into q's dtype.
    q_BSNH = (q_BSNH.astype(jnp.float32) * scale).astype(q_BSNH.dtype)
    run = _per_shard(
        bool(common.resolve_interpret(interpret)), segment_ids_BS is not None, v_BSKV.dtype
    )
    specs = _specs(q_BSNH, k_BSKH)
    args = (q_BSNH, k_BSKH, v_BSKV) + (() if segment_ids_BS is None else (segment_ids_BS,))
    if specs is None:
        return run(*args)
    assert not isinstance(specs, str)  # unfit_reason above
    mesh, q_spec, kv_spec, seg_spec = specs
    in_specs = (q_spec, kv_spec, kv_spec) + (() if segment_ids_BS is None else (seg_spec,))
    out: jax.Array = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=q_spec,
        # pallas_call's outputs carry no varying-mesh-axes types; the specs state them.
        check_vma=False,
    )(*args)
    return out


def _per_shard(interpret: bool, segmented: bool, dtype: DTypeLike) -> Callable[..., jax.Array]:
    """The per-device computation on local [b, S, n, H] q (pre-scaled), k, v (and [b, S]
    segment ids): the splash kernel vmapped over b, heads-major as it wants them."""

    def run(q_bSnH: jax.Array, k_bSkH: jax.Array, v_bSkV: jax.Array, *seg: jax.Array) -> jax.Array:
        s, n = q_bSnH.shape[1], q_bSnH.shape[2]
        blk = block_size(s)
        assert blk is not None  # unfit_reason
        sizes = sak.BlockSizes(
            block_q=blk,
            block_kv=blk,
            block_kv_compute=blk,
            block_q_dkv=blk,
            block_kv_dkv=blk,
            block_kv_dkv_compute=blk,
            block_q_dq=blk,
            block_kv_dq=blk,
        )
        mask = sam.MultiHeadMask([sam.CausalMask((s, s)) for _ in range(n)])
        kernel = sak.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
        q_bnSH, k_bkSH, v_bkSV = (jnp.swapaxes(x, 1, 2) for x in (q_bSnH, k_bSkH, v_bSkV))
        if segmented:
            ids = sak.SegmentIds(q=seg[0], kv=seg[0])
            out_bnSV = jax.vmap(kernel)(q_bnSH, k_bkSH, v_bkSV, ids)
        else:
            out_bnSV = jax.vmap(kernel)(q_bnSH, k_bkSH, v_bkSV)
        return jnp.swapaxes(out_bnSV, 1, 2).astype(dtype)

    return run
