"""Backend "blocked": portable XLA grouped matmul (no Pallas) that is fast on CPU.

Legend: M rows (sorted by group), K contraction, N outputs, G groups in group_sizes, L local
groups (rhs.shape[0]), T a static tile row count, P = M + tm padded rows.

Plan: one loop over the L local groups. A group's rows are a contiguous window of lhs, so each
group reads its rows in place with dynamic slices (no gather of rows, no gather of weights):
  * full tiles of `tm` rows (a loop with the group's own trip count: empty groups cost nothing),
  * then one remainder tile, the smallest of tm, tm/2, ..., max(8, tm/16) rows that holds the
    rest, picked by `lax.switch` (one matmul call; padding under 2x the remainder).
gmm lets a tile run past its group: groups are visited in order, so the next group overwrites
those rows, and rows no local group owns are zeroed once at the end (lhs is padded by one tile
so no slice is clamped). tgmm masks the foreign rows of one operand instead.

Why this shape: on XLA:CPU every dot call pays a fixed cost (weight packing, thread start), as
much as ~100 rows of compute at K=2048, N=768, while padding to a row tile wastes FLOPs. Full
tiles of up to 512 rows run at dense-matmul speed and each group costs (full tiles + 1) calls.
A single batched dot over padded tiles would need a [tiles, K, N] gather of the weights, more
memory traffic than the matmul itself at these shapes. Each distinct tile size is one more
compiled dot, which is why there are only five.

Which dot runs a tile depends on the host (kernels/host_dots.py, `widen_gmm_tiles`). By default
the operands go in as given and tgmm transposes lhs once, so each tile is a row-major
[K, T] @ [T, N] product (YNNPACK's form; bfloat16 stays bfloat16 where the CPU multiplies it).
On an AVX2-class CPU bfloat16 tiles are widened to float32 (YNNPACK's float32 dot is the faster
one there) and tgmm contracts the rows of x[T, K] and y[T, N] directly: XLA:CPU runs that form
with its own (Eigen) dot, without the M x K transpose, faster there at these tile shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import DTypeLike

from moetext.kernels.gmm.backend import GmmBackend, GmmCall, TilingArg, register
from moetext.kernels.host_dots import widen_gmm_tiles
from moetext.kernels.pallas.common import pow2_ceil

_MAX_TM = 512  # larger full tiles gain nothing measurable on XLA:CPU and raise the waste bound
_MIN_TM = 128  # below this a full tile is too small to reach matmul speed
_SIZES_BELOW_TM = 16  # smallest remainder tile is tm / 16: each size is one more compiled dot
_CONTRACT_ROWS = (((0,), (0,)), ((), ()))  # x[T, K], y[T, N] -> x.T @ y [K, N]


def choose_tiles(m: int, num_local: int, tiling: TilingArg = None) -> tuple[int, ...]:
    """Static tile row counts, largest first: tiles[0] = tm for full tiles, then the remainder
    sizes tm/2, tm/4, ... down to max(8, tm/16) (all powers of two, all <= M).

    By default tm is the mean group size rounded up to a power of two, clamped to [128, 512]; a
    group a little over the mean is then one full tile plus a small remainder tile. (Twice the
    mean, the rule before, padded every group just over a power-of-two mean to a whole tile of
    twice its size: 1.6x the rows at bench-tiny-moe's 8 experts of ~256 rows; the rule here ran
    its fwd+bwd gmm in 0.76-0.88x the time, docs/performance.md.) tiling[0] overrides it
    (rounded up to a power of two). tm never exceeds M (rounded down to a power of two)
    because tiles are clamped slices of lhs.
    """
    if tiling is not None and not callable(tiling):
        tm = pow2_ceil(tiling[0])
    else:  # a callable tiling is a per-chip TPU table (pallas/tiling.py); CPU tiles are chosen here
        tm = min(_MAX_TM, max(_MIN_TM, pow2_ceil(m // max(num_local, 1))))
    tm = min(tm, 1 << (max(m, 1).bit_length() - 1))
    smallest = min(tm, max(8, tm // _SIZES_BELOW_TM))
    return tuple(tm >> i for i in range((tm // smallest).bit_length()))


def _acc_dtype(pet: DTypeLike) -> jnp.dtype:
    # Low-precision outputs still accumulate in f32 (as ragged_dot and the MXU do); on XLA:CPU a
    # bf16 x bf16 -> f32 dot costs the same as bf16 -> bf16.
    out = jnp.dtype(pet)
    if jnp.issubdtype(out, jnp.floating):
        out = jnp.promote_types(out, jnp.float32)
    return out


def _group_window(
    group_sizes: jax.Array, group_offset: jax.Array, i: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Start row and size of local group i (size 0 if the window runs past the real groups)."""
    ends = jnp.cumsum(group_sizes)
    g = group_offset + i
    gc = jnp.minimum(g, group_sizes.shape[0] - 1)
    size = jnp.where(g < group_sizes.shape[0], group_sizes[gc], 0)
    return ends[gc] - group_sizes[gc], size


def _remainder_branch(rem: jax.Array, tiles: tuple[int, ...]) -> jax.Array:
    """0 if rem == 0, else b such that tiles[-b] is the smallest tile size holding rem rows."""
    ascending = jnp.asarray(tiles[::-1][:-1])
    return jnp.where(rem > 0, jnp.sum(ascending < rem) + 1, 0)


def _for_each_tile(
    carry: jax.Array,
    start: jax.Array,
    size: jax.Array,
    tiles: tuple[int, ...],
    tile_fn: Callable[[jax.Array, jax.Array, int], jax.Array],
) -> jax.Array:
    """Calls tile_fn(carry, row0, rows) for tiles covering rows [start, start + size).

    Full tiles of tiles[0] rows, then one tile for the remainder: the smallest size in `tiles`
    that holds it (so at most one extra call per group, padding below 2x the remainder).
    """
    tm = tiles[0]
    full = size // tm
    carry = lax.fori_loop(0, full, lambda j, c: tile_fn(c, start + j * tm, tm), carry)
    row0 = start + full * tm

    def remainder(rows: int) -> Callable[[jax.Array], jax.Array]:
        return lambda c: tile_fn(c, row0, rows)

    branches: list[Callable[[jax.Array], jax.Array]] = [lambda c: c]
    branches += [remainder(t) for t in tiles[::-1]]
    out: jax.Array = lax.switch(_remainder_branch(size - full * tm, tiles), branches, carry)
    return out


def _widened(x: jax.Array, widen: bool) -> jax.Array:
    """x in float32 if widen and x is bfloat16 (exact; module docstring), else x."""
    return x.astype(jnp.float32) if widen and x.dtype == jnp.bfloat16 else x


def _row_slice(
    x_MX: jax.Array, row0: jax.Array, rows: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x[row0 : row0 + rows] clamped into range, and the mask of rows in [row0, row0 + rows)."""
    s = jnp.clip(row0, 0, x_MX.shape[0] - rows)
    r = s + jnp.arange(rows)
    return s, lax.dynamic_slice_in_dim(x_MX, s, rows, 0), (r >= row0) & (r < row0 + rows)


@dataclasses.dataclass(frozen=True)
class BlockedBackend(GmmBackend):
    """Per-group row tiles over lax.dot_general; jit-able with traced group_sizes."""

    name: ClassVar[str] = "blocked"

    def gmm(self, lhs_MK: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        """Grouped matmul by per-group row tiles; see the module docstring."""
        return _gmm(lhs_MK, rhs, group_sizes, call)

    def tgmm(self, lhs_MK: Array, rhs_MN: Array, group_sizes: Array, call: GmmCall) -> Array:
        """out[g] = lhs[rows of g].T @ rhs[rows of g] by per-group row tiles -> [L, K, N]."""
        return _tgmm(lhs_MK, rhs_MN, group_sizes, call)


register("blocked", BlockedBackend)


def _gmm(lhs_MK: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
    m = lhs_MK.shape[0]
    num_local = rhs.shape[0]
    n = rhs.shape[1] if call.transpose_rhs else rhs.shape[2]
    pet = jnp.dtype(call.out_dtype)
    acc = _acc_dtype(pet)
    tiles = choose_tiles(m, num_local, call.tiling)
    contract = (((1,), (1,)), ((), ())) if call.transpose_rhs else (((1,), (0,)), ((), ()))
    offset = jnp.asarray(call.group_offset, jnp.int32)
    widen = widen_gmm_tiles()

    # Tiles run past their group's end: groups are visited in order, so those rows are later
    # overwritten by their own group, and rows no local group owns are zeroed once at the end.
    # Padding lhs by one tile (one M*K copy) removes clamping, so no tile needs a row mask.
    lhs_PK = jnp.pad(lhs_MK, ((0, tiles[0]), (0, 0)))

    def group(i: jax.Array, out_PN: jax.Array) -> jax.Array:
        start, size = _group_window(group_sizes, offset, i)
        w = _widened(lax.dynamic_index_in_dim(rhs, i, 0, keepdims=False), widen)

        def tile(out_PN: jax.Array, row0: jax.Array, rows: int) -> jax.Array:
            x_TK = _widened(lax.dynamic_slice_in_dim(lhs_PK, row0, rows, 0), widen)
            y_TN = lax.dot_general(x_TK, w, contract, preferred_element_type=acc).astype(pet)
            return lax.dynamic_update_slice_in_dim(out_PN, y_TN, row0, 0)

        return _for_each_tile(out_PN, start, size, tiles, tile)

    out_PN = lax.fori_loop(0, num_local, group, jnp.zeros((m + tiles[0], n), pet))
    ends = jnp.cumsum(group_sizes)
    lo = (ends - group_sizes)[jnp.minimum(offset, group_sizes.shape[0] - 1)]
    hi = ends[jnp.minimum(offset + num_local, group_sizes.shape[0]) - 1]
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= lo) & (rows < hi), out_PN[:m], jnp.zeros((), pet))


def _tgmm(lhs_MK: Array, rhs_MN: Array, group_sizes: Array, call: GmmCall) -> Array:
    m, k = lhs_MK.shape
    n = rhs_MN.shape[1]
    num_groups = call.local_groups
    pet = jnp.dtype(call.out_dtype)
    acc = _acc_dtype(pet)
    tiles = choose_tiles(m, num_groups, call.tiling)
    offset = jnp.asarray(call.group_offset, jnp.int32)
    # XLA:CPU hands YNNPACK only row-major dots that contract lhs columns; x_tile.T @ y_tile
    # written as a row contraction goes to its own (Eigen) dot instead, measured several times
    # slower when this was written (53d6969, host not recorded). So lhs is transposed once up
    # front (an M*K copy) and each tile is a plain [K, T] @ [T, N] product, except on an
    # AVX2-class CPU, where the row contraction is the faster form (module docstring).
    lhs_KM = None if widen_gmm_tiles() else jnp.transpose(lhs_MK)

    def group(i: jax.Array, out_LKN: jax.Array) -> jax.Array:
        start, size = _group_window(group_sizes, offset, i)
        end = start + size

        def product(row0: jax.Array, rows: int) -> jax.Array:
            s, y_TN, mask = _row_slice(rhs_MN, row0, rows)
            mask &= s + jnp.arange(rows) < end
            # Zeroing the foreign rows of one operand removes their whole contribution.
            y_TN = jnp.where(mask[:, None], y_TN, jnp.zeros((), y_TN.dtype))
            if lhs_KM is None:  # the row-contraction form, operands widened
                x_TK = _widened(lax.dynamic_slice_in_dim(lhs_MK, s, rows, 0), True)
                return lax.dot_general(
                    x_TK, _widened(y_TN, True), _CONTRACT_ROWS, preferred_element_type=acc
                )
            x_KT = lax.dynamic_slice_in_dim(lhs_KM, s, rows, 1)
            return jnp.dot(x_KT, y_TN, preferred_element_type=acc)

        # The remainder tile first, so that a group of one tile (the common case at large G)
        # writes its product straight out: no zero-filled K x N accumulator, no extra add.
        tm = tiles[0]
        full = size // tm
        row_rem = start + full * tm

        def remainder(rows: int) -> Callable[[], jax.Array]:
            return lambda: product(row_rem, rows)

        branches: list[Callable[[], jax.Array]] = [lambda: jnp.zeros((k, n), acc)]
        branches += [remainder(t) for t in tiles[::-1]]
        acc_KN = lax.switch(_remainder_branch(size - full * tm, tiles), branches)
        acc_KN = lax.fori_loop(0, full, lambda j, a: a + product(start + j * tm, tm), acc_KN)
        return out_LKN.at[i].set(acc_KN.astype(pet))

    out: jax.Array = lax.fori_loop(0, num_groups, group, jnp.zeros((num_groups, k, n), pet))
    return out
