"""Weights that arrive sharded: all-gather them for a grouped matmul, reduce-scatter the gradient.

Inside `jax.shard_map` an FSDP-sharded expert weight is a local slice; `gmm(..., rhs_gather=g)`
takes that slice plus a `Gather`: the (dim, mesh axes) pairs along which the slice is split, in
the order they are gathered. The backward reduces the weight gradient with `psum_scatter` along
the same pairs in reverse order, so each shard ends up with the gradient of its own slice.
The reduction runs in the slice's dtype unless a `grad_reduce_dtype` is given (bfloat16 halves
the bytes and the full-size gradient buffer the reduction needs, at bf16 summation precision).

The plain path (`gather_weight`) casts the slice to the compute dtype first, so the wire carries
bf16 rather than f32 master weights, and reduce-scatters the gradient in the slice's own dtype
(f32 master weights get an f32 reduction). This is `Recipe.gathered_gmm`'s default; the
fp8_blockwise recipe with `qag=True` replaces it with a quantized all-gather (kernels/quant/qag.py).

`reduce_scatter_tiled` is the memory-lean form of the gradient's reduction: it computes the
full-size gradient a tile at a time and reduce-scatters each tile before computing the next, so
no layer holds a full unsharded weight gradient (recipe.NoQuantization uses it).

Collectives run one mesh axis at a time (a tuple of axes is gathered innermost axis first and
reduce-scattered outermost first, which is the same block order as the joint collective), so a
mesh that splits one axis of devices into several mesh axes (moetext.sharding.torus) gets one
collective per mesh axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.typed_jax import finfo, psum_scatter

# ((dim, (mesh axis, ...)), ...): dims of a local slice split over mesh axes, gathered in order.
Gather = tuple[tuple[int, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """How a gmm gets a sharded weight slice (`Recipe.gathered_gmm`): the (dim, mesh axes)
    pairs it is gathered along, the dtype its gradient is reduce-scattered in (None: the
    slice's own), whether the backward gathers it again instead of keeping the forward's
    gathered copy (`Gmm.regather_weights`), and whether each dim's mesh axes are all-gathered
    in one collective (`jointly`; the gradient's reduce-scatter stays one axis at a time).

    Why jointly: a mesh axis split in two for XLA:TPU's sake (sharding/torus.py) needs the
    split for its reduce-scatters, but on most slices (v5p:4x4x2, 2x4x4, 2D ones) not for its
    all-gathers; gathered in two stages the weight is written to HBM half-gathered and read
    back (moetext.models.moe.ep sets it where the whole gather stays an all-gather)."""

    dims: Gather
    reduce_dtype: jnp.dtype | None = None
    regather: bool = False
    jointly: bool = False


def check_gather(gather: Iterable[Any] | None, ndim: int) -> Gather:
    """Normalises a Gather and rejects malformed ones with the offending entry named."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for entry in gather or ():
        try:
            dim, axes = entry
        except (TypeError, ValueError):
            raise ValueError(
                f"rhs_gather entries must be (dim, mesh axes) pairs, got {entry!r}"
            ) from None
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not 0 <= int(dim) < ndim or not axes:
            raise ValueError(
                f"rhs_gather entry {entry!r}: dim must be in [0, {ndim}) with at least one mesh "
                f"axis"
            )
        out.append((int(dim), axes))
    dims = [d for d, _ in out]
    if len(set(dims)) != len(dims):
        raise ValueError(f"rhs_gather names a dim twice: {gather!r}")
    return tuple(out)


def gathered_shape(shape: tuple[int, ...], gather: Gather) -> tuple[int, ...]:
    """The full (gathered) shape of a local slice; must run where the mesh axes are bound."""
    full = list(shape)
    for dim, axes in gather:
        full[dim] *= math.prod(jax.lax.axis_size(a) for a in axes)
    return tuple(full)


def local_shape(shape: tuple[int, ...], gather: Gather) -> tuple[int, ...]:
    """The local slice's shape of a gathered (full) shape; must run where the axes are bound."""
    local = list(shape)
    for dim, axes in gather:
        local[dim] //= math.prod(jax.lax.axis_size(a) for a in axes)
    return tuple(local)


# The lanes of a TPU vreg: XLA:TPU tiles an array's two minor dims in (8, 128) blocks (f32).
TPU_LANES = 128


def minor_swapped(shape: tuple[int, ...], gather: Gather) -> Gather | None:
    """The gather of a [G, K, N] weight slice with its last two dims swapped, when the slice is
    better gathered that way; else None. Gmm then multiplies by the swapped slice with
    transpose_rhs flipped: the same matmul, the same numbers.

    When: only the last dim is gathered and its local extent is under TPU_LANES (fsdp = 32 on
    Qwen3-30B-A3B's w_down [128, 768, 2048] leaves [128, 768, 64] per chip). XLA:TPU stores such
    a slice with the narrow dim second-minor (the 768 lanes minor: no padding), while its
    all-gather and the Mosaic kernel after it want the gathered dim major. Gathered along N it
    got the parameter copied to a new layout, hoisted out of the layer scan: a copy of every
    layer's slice, 1.12 GiB per chip (docs/performance.md). Swapped, the slice as stored is
    already the [G, N, K] the gather wants, exactly as w_gate's [G, K = D, N = F] slice is:
    the swap is a bitcast, and nothing is copied. With a wider local N (>= 128 lanes, stored
    row-major) the swap would be a real transpose per layer, so it is not done.

    Gmm asks only for a [G, K, N] slice (transpose_rhs=False, the layout of every model weight):
    a [G, N, K] one split along K could be swapped the same way, but on CPU its bf16 backward
    then sums in another order (dlhs 1.2e-4 of the largest entry apart, measured once on
    qag_worker.py's transposed layout), and no layer needs it. The rule is the same on every
    platform: on CPU and GPU the swap is a transpose of the local slice (small next to the
    gathered weight) and changes no number. A fixed (tm, tk, tn) tiling then meets the weight
    gradient's tgmm as [G, N, K] (tk along N), which changes tiles, not results."""
    dims = dict(gather)
    if len(shape) != 3 or 2 not in dims or 1 in dims or shape[2] >= TPU_LANES:
        return None
    return tuple((1 if d == 2 else d, axes) for d, axes in gather)


def all_gather_dims(x: jax.Array, gather: Gather, jointly: bool = False) -> jax.Array:
    """x all-gathered (tiled) along each (dim, axes) in order; a tuple of axes innermost first,
    or (jointly) in one collective over the tuple, which puts the blocks in the same order."""
    for dim, axes in gather:
        if jointly and len(axes) > 1:
            x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
            continue
        for axis in reversed(axes):
            x = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return x


def psum_scatter_dims(x: jax.Array, gather: Gather) -> jax.Array:
    """The transpose of all_gather_dims: reduce-scatter along the same dims in reverse order."""
    for dim, axes in reversed(gather):
        for axis in axes:
            x = psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
    return x


def reduce_scatter_grad(
    g: jax.Array, gather: Gather, reduce_dtype: DTypeLike | None, w_dtype: DTypeLike
) -> jax.Array:
    """A gathered weight's gradient -> this shard's slice: psum_scatter in reduce_dtype (None:
    w_dtype), returned in w_dtype."""
    rd = jnp.dtype(reduce_dtype or w_dtype)
    return psum_scatter_dims(g.astype(rd), gather).astype(w_dtype)


def narrow(w: jax.Array, dtype: DTypeLike) -> jax.Array:
    """w.astype(dtype); a float cast to a 16-bit float is rounded by reduce_precision first,
    which changes no value (the cast rounds the same way) but keeps the cast where it is.

    Why: a bare narrowing cast of a scanned layer's weight slice is moved by XLA above the
    scan's dynamic-slice and then hoisted out of the loop, so the step keeps a bf16 copy of
    every layer's weights for its whole duration (1.7 GiB per chip for Qwen3-30B-A3B's experts
    on v5p-64, docs/performance.md). XLA does not move reduce_precision, so each layer casts
    its own slice when it gathers it.
    """
    dtype = jnp.dtype(dtype)
    floats = jnp.issubdtype(w.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
    if floats and dtype.itemsize == 2 < w.dtype.itemsize:
        fi = finfo(dtype)
        w = jax.lax.reduce_precision(w, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return w.astype(dtype)


# --- the weight gradient, a tile at a time -----------------------------------------------------

# A gathered weight's gradient is computed and reduce-scattered in tiles of at most
# GRAD_TILE_BYTES (full size, in the reduction dtype; GRAD_TILE_BYTES_16BIT when that dtype is
# bf16 or f16), each at least MIN_TILE_COLS wide along the tiled dim. Each tile's tgmm reads the
# whole dout (or lhs) again, so fewer tiles move fewer HBM bytes, and larger tiles may hold more
# memory. Measured on v5p (docs/performance.md, "TPU step cost against MaxText"): reduced in
# bf16 (the pod configs), the 30B experts' [128, 2048, 768] gradient (384 MiB) in one piece
# instead of 2 tiles takes 101 GB fewer HBM bytes per step on v5p-64, 235B's [128, 4096, 1536]
# (1.5 GiB) in one piece instead of 4 tiles 419 GB fewer on v5p-256, each at the same peak
# memory; reduced in f32, the 30B gradient (768 MiB) in 2 tiles of 384 MiB instead of 3 of 256
# cost 0.61 GiB more per chip (the 2-layer step of tests/sharding/test_aot.py), so f32 keeps
# 256 MiB (235B: 6 tiles of 512 MiB, 256 columns each, the least). The 16-bit limit is 3 GiB
# (was 1.5): 235B's fused gate|up gradient [128, 4096, 3072] (kernels.fuse_gate_up) in one
# piece rather than 2 tiles (-150 GB, 40.52 GiB per chip instead of 43.33), DeepSeek-V3's
# [256, 7168, 2048] (7 GiB) in 4 tiles rather than 8 (-671 GB on v5p-1024, the same 61.99 GiB).
GRAD_TILE_BYTES = 256 * 2**20
GRAD_TILE_BYTES_16BIT = 3072 * 2**20
MIN_TILE_COLS = 256


@contextlib.contextmanager
def grad_tile_limits(max_bytes: int, min_cols: int) -> Iterator[None]:
    """GRAD_TILE_BYTES (both) and MIN_TILE_COLS set for what is traced inside (restored
    after): small values make small test shapes go through several tiles, as full-size weights
    do."""
    global GRAD_TILE_BYTES, GRAD_TILE_BYTES_16BIT, MIN_TILE_COLS
    saved = GRAD_TILE_BYTES, GRAD_TILE_BYTES_16BIT, MIN_TILE_COLS
    GRAD_TILE_BYTES = GRAD_TILE_BYTES_16BIT = max_bytes
    MIN_TILE_COLS = min_cols
    try:
        yield
    finally:
        GRAD_TILE_BYTES, GRAD_TILE_BYTES_16BIT, MIN_TILE_COLS = saved


def grad_tiles(shape: tuple[int, ...], shards: dict[int, int], itemsize: int) -> tuple[int, int]:
    """(dim, count): how `reduce_scatter_tiled` splits the gradient of a gathered weight of full
    shape [G, K, N] whose dims are split into shards[dim] slices (absent: 1), reduced in
    itemsize-byte elements. It tiles dim 2 or 1, an ungathered one if there is one (contiguous
    column tiles), else the one with more columns per shard; count is the fewest tiles of at
    most GRAD_TILE_BYTES (GRAD_TILE_BYTES_16BIT for 2-byte elements), each at least
    MIN_TILE_COLS wide, that divide each shard's columns (the most that do when none is small
    enough)."""
    split = {d: shards.get(d, 1) for d in (1, 2)}
    ungathered = [d for d in (2, 1) if split[d] == 1]
    dim = ungathered[0] if ungathered else max((2, 1), key=lambda d: shape[d] // split[d])
    per_shard = shape[dim] // split[dim]
    full_bytes = math.prod(shape) * itemsize
    limit = GRAD_TILE_BYTES_16BIT if itemsize == 2 else GRAD_TILE_BYTES
    count = 1
    for c in range(1, per_shard + 1):
        if per_shard % c or shape[dim] // c < min(MIN_TILE_COLS, shape[dim]):
            continue
        count = c
        if full_bytes // c <= limit:
            break
    return dim, count


def _tile(x: jax.Array, n: int, count: int, t: jax.Array) -> jax.Array:
    """Columns of x [M, C] viewed as (n shards, count tiles, width): tile t of every shard,
    [M, n * width]. n = 1 is a contiguous column block."""
    m, cols = x.shape
    width = cols // (n * count)
    view = x.reshape(m, n, count, width)
    piece: jax.Array = jax.lax.dynamic_index_in_dim(view, t, axis=2, keepdims=False)
    return piece.reshape(m, n * width)


def _tile_cols(x: Any, n: int, count: int, t: jax.Array) -> Any:
    """_tile on every leaf of x: an array, or a pytree whose leaves all have x's columns as
    their last axis (an FP8 operand blocked along M: values [M, C], scales [M / bs, C])."""
    return jax.tree.map(lambda leaf: _tile(leaf, n, count, t), x)


def reduce_scatter_tiled(
    grad_of: Callable[[Any, Any], jax.Array],
    a: Any,
    b: Any,
    shape: tuple[int, int, int],
    gather: Gather,
    reduce_dtype: DTypeLike | None,
    w_dtype: DTypeLike,
) -> jax.Array:
    """reduce_scatter_grad(grad_of(a, b), gather, ...) without the full-size gradient.

    grad_of(a [M, K'], b [M, N']) -> [G, K', N'] is a gathered weight's gradient (a tgmm) for
    the columns given; `shape` = [G, K, N] is its full size. a and b may be pytrees whose
    leaves all end in the columns (FP8 values and scales blocked along M, kernels/quant). The
    gradient is computed and reduce-scattered a tile at a time (`grad_tiles`) in a loop, so at
    most one full-size tile exists. A tile of a gathered dim takes the same columns of every
    shard's block (the dim viewed as (shards, tiles, width)), so its reduce-scatter hands each
    shard a piece of its own slice; the pieces land in order. Each output element is computed
    exactly as in the untiled gradient.
    """
    rd = jnp.dtype(reduce_dtype or w_dtype)
    shards = {d: math.prod(jax.lax.axis_size(ax) for ax in axes) for d, axes in gather}
    dim, count = grad_tiles(shape, shards, rd.itemsize)
    if count == 1:
        return reduce_scatter_grad(grad_of(a, b), gather, rd, w_dtype)
    n = shards.get(dim, 1)
    width = shape[dim] // (n * count)
    local = local_shape(shape, gather)

    def step(t: jax.Array, acc: jax.Array) -> jax.Array:
        a_t = _tile_cols(a, n, count, t) if dim == 1 else a
        b_t = _tile_cols(b, n, count, t) if dim == 2 else b
        part = psum_scatter_dims(grad_of(a_t, b_t).astype(rd), gather).astype(acc.dtype)
        return jax.lax.dynamic_update_slice_in_dim(acc, part, t * width, axis=dim)

    out: jax.Array = jax.lax.fori_loop(0, count, step, jnp.zeros(local, w_dtype))
    return out


def gather_weight(
    w: jax.Array,
    gather: Gather,
    dtype: DTypeLike,
    reduce_dtype: DTypeLike | None = None,
    jointly: bool = False,
) -> jax.Array:
    """all_gather_dims(narrow(w, dtype), gather, jointly); the gradient is psum_scatter'ed in
    reduce_dtype (default w.dtype) and returned in w.dtype."""
    if not gather:
        return w.astype(dtype)
    rd = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    out: jax.Array = _gather_cast(
        gather, jnp.dtype(dtype), jnp.dtype(w.dtype), rd, bool(jointly), w
    )
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gather_cast(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    jointly: bool,
    w: jax.Array,
) -> jax.Array:
    return all_gather_dims(narrow(w, dtype), gather, jointly)


def _gather_cast_fwd(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    jointly: bool,
    w: jax.Array,
) -> tuple[jax.Array, None]:
    out: jax.Array = _gather_cast(gather, dtype, w_dtype, reduce_dtype, jointly, w)
    return out, None


def _gather_cast_bwd(
    gather: Gather,
    dtype: jnp.dtype,
    w_dtype: jnp.dtype,
    reduce_dtype: jnp.dtype | None,
    jointly: bool,
    _: None,
    g: jax.Array,
) -> tuple[jax.Array]:
    return (reduce_scatter_grad(g, gather, reduce_dtype, w_dtype),)


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)
