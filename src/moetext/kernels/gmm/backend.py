"""The grouped-matmul backend protocol (`GmmBackend`) and its registry.

Shapes: M rows of tokens sorted by group, K contraction, N output features, G groups (G_local
on an expert-parallel shard). A backend implements the forward math of `gmm` and `tgmm`;
autodiff, input checks and quantization live above it (`api.Gmm`, `recipe.Recipe`), written
once for every backend. Adding a backend is adding a module that subclasses `GmmBackend` and
calls `register`; there are no boolean flags.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from moetext.kernels.pallas.tiling import Tiling, TilingArg

__all__ = ["GmmBackend", "GmmCall", "Tiling", "TilingArg", "get_backend", "register"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GmmCall:
    """What one gmm / tgmm call carries besides its operands, passed as one object from `Gmm`
    through the recipe to the backend (and to a recipe's scaled kernels).

    out_dtype: the output dtype (jax's preferred_element_type); accumulation is f32 at least.
    group_offset: [] int32, traced: rhs[i] (gmm) / out[i] (tgmm) serves group group_offset + i.
    tiling: fixed (tm, tk, tn), a callable (m, k, n, dtype, chip) -> tiles, or None for each
      backend's default.
    transpose_rhs: gmm reads rhs as [G_local, N, K]; tgmm ignores it.
    num_groups: tgmm's G_local (the groups of its output); gmm reads G_local off rhs.
    rows_covered: gmm only: the caller guarantees every lhs row belongs to a local group (all
      groups local, sum(group_sizes) == M), so a backend need not initialise rows outside them
      (pallas_tpu then writes no zeros buffer ahead of the kernel). The backward's dlhs gmm
      covers the same rows.

    A pytree: group_offset is its one leaf, the rest is static, so a call passes through jit
    and custom_vjp as an ordinary argument and `replace` derives the backward's calls.
    """

    out_dtype: DTypeLike = dataclasses.field(metadata={"static": True})  # a jnp.dtype once built
    group_offset: jax.Array
    tiling: TilingArg = dataclasses.field(default=None, metadata={"static": True})
    transpose_rhs: bool = dataclasses.field(default=False, metadata={"static": True})
    num_groups: int | None = dataclasses.field(default=None, metadata={"static": True})
    rows_covered: bool = dataclasses.field(default=False, metadata={"static": True})

    def replace(self, **changes: Any) -> GmmCall:
        """This call with some fields changed."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dtype", jnp.dtype(self.out_dtype))

    @property
    def local_groups(self) -> int:
        """tgmm's G_local; a ValueError when the call does not say it."""
        if self.num_groups is None:
            raise ValueError("tgmm: GmmCall.num_groups (the local groups of the output) is unset")
        return self.num_groups


class GmmBackend(abc.ABC):
    """A grouped-matmul backend: forward `gmm` and `tgmm` only.

    Required: `name` (the registry name) and the two forward methods below. Shapes are static;
    `group_sizes` and `call.group_offset` are traced. Rows outside the local groups come out
    zero. Autodiff and quantization live above (`recipe.Recipe`); fused kernels for FP8
    operands are the quantization room's (kernels/quant/scaled_kernels.py), not a backend's.

    Backends are frozen dataclasses (or otherwise hashable by value): a backend is a static
    argument of jit and custom_vjp, so two equal backends must hash equal.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def gmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [G_local, K, N] ([G_local, N, K] when call.transpose_rhs)
        group_sizes: jax.Array,  # [G] int32, G >= G_local
        call: GmmCall,
    ) -> jax.Array:
        """[M, N]: rows of local group g = lhs rows @ rhs[g - group_offset]; other rows zero.
        Accumulates in float32 at least; the output is `call.out_dtype`."""

    @abc.abstractmethod
    def tgmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [M, N]
        group_sizes: jax.Array,  # [G] int32
        call: GmmCall,  # call.num_groups = G_local
    ) -> jax.Array:
        """[G_local, K, N]: out[i] = lhs[rows of g].T @ rhs[rows of g], g = group_offset + i;
        zero for empty groups."""


_REGISTRY: dict[str, Callable[[], GmmBackend]] = {}
_AUTO = {"tpu": "pallas_tpu", "cpu": "blocked", "gpu": "ragged_dot", "cuda": "ragged_dot"}


def register(name: str, factory: Callable[[], GmmBackend]) -> None:
    """Makes `factory()` available as `get_backend(name)`."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def auto_backend_name(platform: str | None = None) -> str:
    platform = platform or jax.default_backend()
    name = _AUTO.get(platform, "ragged_dot")
    return name if name in _REGISTRY else "ragged_dot"


def get_backend(name: str | GmmBackend = "auto") -> GmmBackend:
    """A backend by registry name ("auto" picks by platform), or a backend object as is."""
    if not isinstance(name, str):
        if not isinstance(name, GmmBackend):
            raise ValueError(f"backend must be a name or a GmmBackend, got {type(name).__name__}")
        return name
    if name == "auto":
        name = auto_backend_name()
    if name not in _REGISTRY:
        valid = ", ".join(["auto", *available_backends()])
        raise ValueError(f"unknown gmm backend {name!r}; valid names: {valid}")
    return _REGISTRY[name]()
