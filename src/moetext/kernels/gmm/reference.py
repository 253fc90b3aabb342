"""Float64 NumPy oracles for gmm/tgmm, and the "reference" backend that runs them in a callback.

Legend: M rows (sorted by group), K contraction, N outputs, G groups in group_sizes, L local
groups (rhs.shape[0] for gmm, num_groups for tgmm) serving groups
[group_offset, group_offset + L).

These loops are the definition every backend is tested against: slow, obvious, float64.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import ClassVar, SupportsInt

import jax
import numpy as np
import numpy.typing as npt
from jax import Array

from moetext.kernels.gmm.backend import GmmBackend, GmmCall, register
from moetext.kernels.typed_jax import ShapeDtypeStruct


def _windows(
    group_sizes: npt.ArrayLike, group_offset: SupportsInt, num_local: int
) -> Iterator[tuple[int, int, int]]:
    """(local index, first row, last row + 1) for each local group that exists in group_sizes."""
    sizes = np.asarray(group_sizes).astype(np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    offset = int(group_offset)
    for i in range(num_local):
        g = offset + i
        if 0 <= g < len(sizes):
            yield i, int(starts[g]), int(ends[g])


def gmm_reference(
    lhs: npt.ArrayLike,
    rhs: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    transpose_rhs: bool = False,
    group_offset: SupportsInt = 0,
) -> npt.NDArray[np.float64]:
    """[M, N] float64: rows of local group g = lhs rows @ rhs[g - group_offset]; others zero.

    lhs [M, K]; rhs [L, K, N] ([L, N, K] when transpose_rhs); group_sizes [G] int.
    """
    lhs_MK = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    rhs_LKN = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out_MN = np.zeros((lhs_MK.shape[0], rhs_LKN.shape[2]), np.float64)
    for i, lo, hi in _windows(group_sizes, group_offset, rhs_LKN.shape[0]):
        out_MN[lo:hi] = lhs_MK[lo:hi] @ rhs_LKN[i]
    return out_MN


def tgmm_reference(
    lhs: npt.ArrayLike,
    rhs: npt.ArrayLike,
    group_sizes: npt.ArrayLike,
    *,
    num_groups: int | None = None,
    group_offset: SupportsInt = 0,
) -> npt.NDArray[np.float64]:
    """[L, K, N] float64: out[i] = lhs[rows of g].T @ rhs[rows of g] for g = group_offset + i.

    lhs [M, K]; rhs [M, N]; num_groups (L) defaults to len(group_sizes); empty groups are zero.
    """
    lhs_MK = np.asarray(lhs, np.float64)
    rhs_MN = np.asarray(rhs, np.float64)
    num_local = len(np.asarray(group_sizes)) if num_groups is None else int(num_groups)
    out_LKN = np.zeros((num_local, lhs_MK.shape[1], rhs_MN.shape[1]), np.float64)
    for i, lo, hi in _windows(group_sizes, group_offset, num_local):
        out_LKN[i] = lhs_MK[lo:hi].T @ rhs_MN[lo:hi]
    return out_LKN


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(GmmBackend):
    """The oracles behind jax.pure_callback: works under jit, and under grad via the api vjp."""

    name: ClassVar[str] = "reference"

    def gmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        n = rhs.shape[1] if call.transpose_rhs else rhs.shape[2]
        oracle = functools.partial(gmm_reference, transpose_rhs=call.transpose_rhs)
        return _on_host(oracle, (lhs.shape[0], n), call, lhs, rhs, group_sizes)

    def tgmm(self, lhs: Array, rhs: Array, group_sizes: Array, call: GmmCall) -> Array:
        g = call.local_groups
        oracle = functools.partial(tgmm_reference, num_groups=g)
        return _on_host(oracle, (g, lhs.shape[1], rhs.shape[1]), call, lhs, rhs, group_sizes)


def _on_host(
    oracle: Callable[..., npt.NDArray[np.float64]],
    shape: tuple[int, ...],
    call: GmmCall,
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    """oracle(lhs, rhs, group_sizes, group_offset=...) through jax.pure_callback, cast to
    call.out_dtype."""
    pet = call.out_dtype

    def host(
        lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray, group_offset: np.ndarray
    ) -> np.ndarray:
        return oracle(lhs, rhs, group_sizes, group_offset=group_offset).astype(pet)

    out: jax.Array = jax.pure_callback(
        host, ShapeDtypeStruct(shape, pet), lhs, rhs, group_sizes, call.group_offset
    )
    return out


register("reference", ReferenceBackend)
