"""The TPU the Pallas kernels compile for when it is not this process's device.

An ahead-of-time compile for a TPU topology from a CPU host (moetext.aot) traces the kernels on
a machine whose default backend is the CPU, where `interpret=None` would lower them through
Pallas' interpreter (HLO while loops) instead of Mosaic. `compiling_for(chip)` marks such a
compile: inside it the kernels lower for Mosaic (interpret off) with that chip's tiles and VMEM
limits (`common.resolve_interpret`, `tiling.resolve_chip`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "moetext_pallas_tpu_target", default=None
)


@contextlib.contextmanager
def compiling_for(chip: str) -> Iterator[None]:
    """Kernels traced inside lower for TPU `chip` ('v5e', 'v5p', 'v6e', 'tpu7x')."""
    token = _TARGET.set(chip)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_chip() -> str | None:
    """The chip of the enclosing `compiling_for`, else None."""
    return _TARGET.get()


def tpu_code() -> bool:
    """Whether code traced now runs on a TPU: jax's default backend is TPU, or an enclosing
    `compiling_for` compiles it ahead of time for one."""
    return target_chip() is not None or jax.default_backend() == "tpu"
