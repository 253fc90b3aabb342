"""Annotated names for the jax / ml_dtypes entry points the kernels call that ship unannotated.

`mypy --strict` rejects a call to an unannotated function from typed code. Each name below is
the library object itself, declared with the signature the kernels use, so their call sites stay
checked without a `type: ignore`. Drop a name once its library annotates it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike


class _PsumScatter(Protocol):
    def __call__(
        self,
        x: jax.Array,
        axis_name: str | tuple[str, ...],
        *,
        scatter_dimension: int = 0,
        tiled: bool = False,
    ) -> jax.Array: ...


# jax.ShapeDtypeStruct(shape, dtype): its __init__ is unannotated.
ShapeDtypeStruct: Callable[[Sequence[int], DTypeLike], jax.ShapeDtypeStruct] = jax.ShapeDtypeStruct
# numpy's finfo extended to bfloat16 and the FP8 types (jnp.finfo is this object); its __new__ is
# unannotated.
finfo: Callable[[DTypeLike], np.finfo[Any]] = ml_dtypes.finfo
# jax.lax.psum_scatter is unannotated.
psum_scatter: _PsumScatter = jax.lax.psum_scatter
# jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers, lhs_ragged_dimensions,
# rhs_group_dimensions): its __init__ is unannotated.
RaggedDotDimensionNumbers: Callable[..., jax.lax.RaggedDotDimensionNumbers] = (
    jax.lax.RaggedDotDimensionNumbers
)
# jax.lax.optimization_barrier is unannotated; it returns its argument's pytree.
optimization_barrier: Callable[[Any], Any] = jax.lax.optimization_barrier
