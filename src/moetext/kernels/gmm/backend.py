"""The grouped-matmul backend protocol and its registry.

Shapes: M rows of tokens sorted by group, K contraction, N output features, G groups.
Adding a backend is adding a module that calls `register`; there are no boolean flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

Tiling = tuple[int, int, int]


@runtime_checkable
class GmmBackend(Protocol):
    """What every grouped-matmul backend implements (forward math only; autodiff lives in api).

    A backend that must own its autodiff (QuantizedGmm keeps FP8 residuals) may also define
    `differentiable_gmm` / `differentiable_tgmm` with the same arguments; api calls those
    instead of wrapping the forward in its generic custom_vjp.
    """

    @property
    def name(self) -> str: ...

    def gmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [G_local, K, N] ([G_local, N, K] when transpose_rhs)
        group_sizes: jax.Array,  # [G] int32, G >= G_local
        *,
        preferred_element_type: jnp.dtype,
        transpose_rhs: bool,
        group_offset: jax.Array,  # [] int32: rhs[i] serves group group_offset + i
        tiling: Tiling | None,
    ) -> jax.Array:  # [M, N]; rows outside the local groups (and past sum) are zero
        ...

    def tgmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [M, N]
        group_sizes: jax.Array,  # [G] int32
        *,
        num_groups: int,  # G_local: groups group_offset .. group_offset + num_groups - 1
        preferred_element_type: jnp.dtype,
        group_offset: jax.Array,
        tiling: Tiling | None,
    ) -> jax.Array:  # [G_local, K, N]; zero for empty groups
        ...


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
