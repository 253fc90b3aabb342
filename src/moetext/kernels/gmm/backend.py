"""The grouped-matmul backend protocol (`GmmBackend`) and its registry.

Shapes: M rows of tokens sorted by group, K contraction, N output features, G groups (G_local
on an expert-parallel shard). A backend implements the forward math of `gmm` and `tgmm`;
autodiff, input checks and quantization live above it (`api.Gmm`, `recipe.Recipe`), written
once for every backend. Adding a backend is adding a module that subclasses `GmmBackend` and
calls `register`; there are no boolean flags.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

import jax
from jax.typing import DTypeLike

if TYPE_CHECKING:  # fp8 imports gmm (its Pallas kernels use gmm.tiling): no runtime import
    from moetext.kernels.fp8.quantize import Quantized

Tiling = tuple[int, int, int]
# Per call: fixed (tm, tk, tn), a callable (m, k, n, dtype, chip) -> tiles (a TPU table), or None
# for each backend's default.
TilingArg = Tiling | Callable[..., Tiling] | None


class GmmBackend(abc.ABC):
    """A grouped-matmul backend: forward `gmm` and `tgmm`, and optional hooks with defaults.

    Required: `name` (the registry name) and the two forward methods below. Shapes are static;
    `group_sizes` and `group_offset` are traced. Rows outside the local groups come out zero.

    Optional hook (the default is correct for every backend):
      `scaled_kernels()`: fused kernels for block-scaled low-precision operands (FP8 values plus
        float32 block scales). None, the default, makes a quantization recipe multiply the
        dequantized operands with `gmm` / `tgmm` instead; pallas_tpu returns its FP8 kernels.

    Backends are frozen dataclasses (or otherwise hashable by value): a backend is a static
    argument of jit and custom_vjp, so two equal backends must hash equal.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def gmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [G_local, K, N] ([G_local, N, K] when transpose_rhs)
        group_sizes: jax.Array,  # [G] int32, G >= G_local
        *,
        preferred_element_type: DTypeLike,
        transpose_rhs: bool,
        group_offset: jax.Array,  # [] int32: rhs[i] serves group group_offset + i
        tiling: TilingArg,
    ) -> jax.Array:
        """[M, N]: rows of local group g = lhs rows @ rhs[g - group_offset]; other rows zero.
        Accumulates in float32 at least; the output is `preferred_element_type`."""

    @abc.abstractmethod
    def tgmm(
        self,
        lhs: jax.Array,  # [M, K]
        rhs: jax.Array,  # [M, N]
        group_sizes: jax.Array,  # [G] int32
        *,
        num_groups: int,  # G_local: groups group_offset .. group_offset + num_groups - 1
        preferred_element_type: DTypeLike,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        """[G_local, K, N]: out[i] = lhs[rows of g].T @ rhs[rows of g], g = group_offset + i;
        zero for empty groups."""

    def scaled_kernels(self) -> ScaledKernels | None:
        """This backend's fused kernels for block-scaled operands, or None (the default): a
        recipe then dequantizes the operands and calls `gmm` / `tgmm`."""
        return None


class ScaledKernels(Protocol):
    """Fused grouped matmuls on block-quantized operands (`GmmBackend.scaled_kernels`).

    The operands are `fp8.Quantized` (values, float32 block scales, blocked axis, block size).
    The kernels accumulate the exact products of the low-precision values in float32 and apply
    each block's scales before adding it, so they compute exactly what multiplying the
    dequantized operands in float32 computes, up to float32 summation order.
    """

    def quantize(
        self, x: jax.Array, *, axis: int | None, block_size: int, dtype: DTypeLike
    ) -> Quantized:
        """`Quantized.of(x, ...)` the way these kernels want it fed (e.g. a Pallas quantize
        kernel on TPU); bit-identical to the XLA quantization."""
        ...

    def gmm(
        self,
        lhs: Quantized,  # [M, K], blocks along K
        rhs: Quantized,  # blocks along its contraction axis, or block_size^2 tiles
        group_sizes: jax.Array,
        *,
        preferred_element_type: DTypeLike,
        transpose_rhs: bool,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        """`GmmBackend.gmm` on the dequantized operands, fused."""
        ...

    def tgmm(
        self,
        lhs: Quantized,  # [M, K], blocks along M (the reduction axis)
        rhs: Quantized,  # [M, N], blocks along M
        group_sizes: jax.Array,
        *,
        num_groups: int,
        preferred_element_type: DTypeLike,
        group_offset: jax.Array,
        tiling: TilingArg,
    ) -> jax.Array:
        """`GmmBackend.tgmm` on the dequantized operands, fused."""
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
