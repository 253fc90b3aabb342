"""Tile sizes for the Pallas TPU grouped matmuls (bf16 and FP8): defaults, lookup, block rules.

A tiling is (tm, tk, tn): lhs rows per tile, contraction per grid step, output columns per tile.
Blocks: gmm lhs (tm, tk), rhs (tk, tn) [(tn, tk) with transpose_rhs], out (tm, tn);
tgmm lhs (tm, tk), rhs (tm, tn), out (tk, tn). A tiling may be given per call, as a callable
`(m, k, n, dtype, chip) -> (tm, tk, tn)`, or left to `default_tiling`. Tiles larger than a dim
are clamped to that dim (a block equal to the full dim is always legal on TPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.typing import DTypeLike

from moetext.kernels.pallas import target
from moetext.kernels.pallas.common import Dimensions, cdiv, pow2_ceil

Tiling = tuple[int, int, int]
# Per call: fixed (tm, tk, tn), a callable (m, k, n, dtype, chip) -> tiles (a TPU table), or None
# for each kernel's default.
TilingArg = Tiling | Callable[..., Tiling] | None

MiB = 1 << 20
LANES = 128


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    vmem_bytes: int  # VMEM per TensorCore (jax's pltpu.get_tpu_info_for_chip)
    mxu: int  # MXU width: K and N tiles in multiples of it keep the systolic array full
    tiles: Tiling  # default (tm, tk, tn) for 16-bit operands
    cores: int = 1  # TensorCores behind one JAX device (megacore): "parallel" grid axes split


# Defaults aim for a per-step arithmetic intensity tm*tn/(tm+tn) flop/byte above each chip's
# bf16-flops / HBM-bandwidth ridge (v5e ~240, v5p ~187, v6e ~560, tpu7x ~310 per TensorCore)
# while the double-buffered blocks plus the f32 accumulator stay far below VMEM (~10-16 MiB).
CHIPS: dict[str, ChipSpec] = {
    "v5e": ChipSpec(128 * MiB, 128, (512, 1024, 1024)),
    "v5p": ChipSpec(64 * MiB, 128, (512, 1024, 1024), cores=2),
    "v6e": ChipSpec(128 * MiB, 256, (1024, 1024, 1024)),
    "tpu7x": ChipSpec(64 * MiB, 256, (512, 1024, 1024)),
}
FALLBACK_CHIP = "v5p"  # interpret mode and unknown TPUs: 128-wide MXU, 64 MiB VMEM

_DEVICE_KINDS = {
    "tpu v5 lite": "v5e",
    "tpu v5e": "v5e",
    "tpu v5": "v5p",
    "tpu v5p": "v5p",
    "tpu v6 lite": "v6e",
    "tpu v6e": "v6e",
    "tpu7x": "tpu7x",
    "tpu 7x": "tpu7x",
}


def chip_from_device_kind(device_kind: str) -> str | None:
    """'TPU v5 lite' -> 'v5e', ...; None for kinds without a table entry."""
    return _DEVICE_KINDS.get(device_kind.strip().lower())


def check_chip(chip: str) -> str:
    if chip not in CHIPS:
        raise ValueError(f"unknown TPU chip {chip!r}; known chips: {', '.join(sorted(CHIPS))}")
    return chip


def resolve_chip(chip: str | None) -> str:
    """`chip` checked; None: the chip of an enclosing `target.compiling_for`, else the local
    TPU's generation, else FALLBACK_CHIP."""
    if chip is not None:
        return check_chip(chip)
    if target.target_chip() is not None:
        return check_chip(target.target_chip())  # type: ignore[arg-type]
    if jax.default_backend() == "tpu":
        return chip_from_device_kind(jax.devices()[0].device_kind) or FALLBACK_CHIP
    return FALLBACK_CHIP


def _fit(dim: int, target: int, align: int) -> int:
    """Largest multiple of `align` <= target dividing dim (no ragged tail), else target."""
    if dim <= target:
        return dim
    for t in range(target, target // 2 - 1, -align):
        if t > 0 and dim % t == 0:
            return t
    return target


def default_tiling(
    m: int, k: int, n: int, dtype: DTypeLike, chip: str, *, num_groups: int = 1
) -> Tiling:
    """Per-generation tiles, shrunk for wide dtypes, divisors of K and N where possible.

    tm follows the mean rows per group: a row tile shared by several groups is recomputed once
    per group, so tiles much taller than a group waste MXU work.
    """
    spec = CHIPS.get(chip, CHIPS[FALLBACK_CHIP])
    tm0, tk0, tn0 = spec.tiles
    if jnp.dtype(dtype).itemsize >= 4:
        tk0 //= 2  # keeps VMEM per step near the 16-bit budget
    mean_rows = max(1, m // max(1, num_groups))
    tm = min(tm0, max(LANES, pow2_ceil(mean_rows)))
    tn = _fit(n, tn0, spec.mxu)
    # gmm splits the N tiles across a megacore's TensorCores: one N tile idles a core.
    while cdiv(n, tn) < spec.cores and tn % (2 * LANES) == 0:
        tn //= 2
    return tm, _fit(k, tk0, spec.mxu), tn


def resolve_tiling(
    tiling: TilingArg, m: int, k: int, n: int, dtype: DTypeLike, chip: str, *, num_groups: int
) -> Tiling:
    """The (tm, tk, tn) for one call, clamped to (m, k, n)."""
    given: Sequence[int]
    if tiling is None:
        given = default_tiling(m, k, n, dtype, chip, num_groups=num_groups)
    elif callable(tiling):
        given = tiling(m, k, n, jnp.dtype(dtype), chip)
    else:
        given = tiling
    try:
        tiles = tuple(int(t) for t in given)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn), got {given!r}") from e
    if len(tiles) != 3 or min(tiles) <= 0:
        raise ValueError(f"tiling must be three positive ints (tm, tk, tn), got {tiles}")
    return min(tiles[0], m), min(tiles[1], k), min(tiles[2], n)


def sublanes(dtype: DTypeLike) -> int:
    """Second-minor block multiple: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit (packed rows)."""
    return 8 * max(1, 4 // int(jnp.dtype(dtype).itemsize))


def check_block(
    op: str,
    tiling: Tiling,
    name: str,
    shape: Sequence[int],
    dtype: DTypeLike,
    block: Sequence[tuple[str, int]],
) -> None:
    """TPU rule: the last two block dims divide by (sublanes, 128) or equal the array dims.

    block: ((label, size), (label, size)) for the array's last two dims.
    """
    dt = jnp.dtype(dtype)
    rules = ((sublanes(dt), f"{dt.name} sublane tiling"), (LANES, "lane width"))
    for (label, size), full, (mult, why) in zip(block, shape[-2:], rules, strict=True):
        if size % mult and size != full:
            raise ValueError(
                f"{op}: tiling (tm, tk, tn)={tiling} breaks the TPU block rule for {name} "
                f"{tuple(shape)} {dt.name}: {label}={size} must be a multiple of {mult} ({why}) "
                f"or equal the full dim {full}"
            )


def check_gmm_blocks(
    op: str,
    tiling: Tiling,
    lhs: jax.Array,
    rhs: jax.Array,
    out_dtype: DTypeLike,
    *,
    transpose_rhs: bool,
) -> None:
    """check_block for gmm's lhs [M, K], rhs [L, K, N] ([L, N, K]) and out [M, N]."""
    tm, tk, tn = tiling
    m, n = lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]
    rhs_block = (("tn", tn), ("tk", tk)) if transpose_rhs else (("tk", tk), ("tn", tn))
    check_block(op, tiling, "lhs", lhs.shape, lhs.dtype, (("tm", tm), ("tk", tk)))
    check_block(op, tiling, "rhs", rhs.shape, rhs.dtype, rhs_block)
    check_block(op, tiling, "out", (m, n), out_dtype, (("tm", tm), ("tn", tn)))


def check_tgmm_blocks(
    op: str, tiling: Tiling, lhs: jax.Array, rhs: jax.Array, out_dtype: DTypeLike
) -> None:
    """check_block for tgmm's lhs [M, K], rhs [M, N] and out [L, K, N]."""
    tm, tk, tn = tiling
    k, n = lhs.shape[1], rhs.shape[1]
    check_block(op, tiling, "lhs", lhs.shape, lhs.dtype, (("tm", tm), ("tk", tk)))
    check_block(op, tiling, "rhs", rhs.shape, rhs.dtype, (("tm", tm), ("tn", tn)))
    check_block(op, tiling, "out", (k, n), out_dtype, (("tk", tk), ("tn", tn)))


Block = tuple[int, int, DTypeLike]  # (rows, cols, dtype) of one VMEM block


def vmem_bytes(in_blocks: Sequence[Block], out_block: Block, acc_shape: tuple[int, int]) -> int:
    """Double-buffered input and output blocks plus the f32 accumulator."""

    def nbytes(b: Block) -> int:
        return b[0] * b[1] * int(jnp.dtype(b[2]).itemsize)

    return (
        2 * sum(nbytes(b) for b in in_blocks)
        + 2 * nbytes(out_block)
        + nbytes((*acc_shape, jnp.float32))
    )


def compiler_params(
    op: str, dimensions: Dimensions, tiling: Tiling, needed: int, chip: str
) -> pltpu.CompilerParams:
    """A grouped kernel's Mosaic parameters: its grid's dimension semantics and `vmem_limit`
    for the `needed` VMEM bytes of its tiles."""
    return pltpu.CompilerParams(
        dimension_semantics=dimensions, vmem_limit_bytes=vmem_limit(op, tiling, needed, chip)
    )


def vmem_limit(op: str, tiling: Tiling, needed: int, chip: str) -> int:
    """Scoped-VMEM limit for the compiler; ValueError when the tiles cannot fit at all."""
    cap = CHIPS.get(chip, CHIPS[FALLBACK_CHIP]).vmem_bytes
    # Mosaic keeps internal scratch in VMEM too, so leave a quarter of it free.
    if needed > cap * 3 // 4:
        raise ValueError(
            f"{op}: tiling (tm, tk, tn)={tiling} needs ~{needed / MiB:.1f} MiB of VMEM for "
            f"double-buffered blocks, over 3/4 of the {cap // MiB} MiB on {chip}; use smaller tiles"
        )
    return min(cap * 3 // 4, max(32 * MiB, 2 * needed))
