"""Orbax's NumPy handler with a bound on the bytes in flight, for writing memory-mapped arrays.

Orbax's `NumpyHandler` opens every array of a save and issues each whole array as one
tensorstore write, all at once (its `save_concurrent_gb` limiter does not cover NumPy leaves).
Tensorstore then copies chunks out of the sources as fast as it can encode them, whatever the
disk takes: from memory maps the copies pile up in anonymous memory while the disk is slow
(docs/convert.md, "Memory and disk"). `BoundedNumpyHandler` writes each array in boxes of whole
storage chunks and awaits each box's commit (the file written) before the next one starts,
with at most `slots` boxes of at most `box_bytes` in flight across the whole save. What it
writes is orbax's own format: the same tensorstore spec, read back by the stock handler.

Bounding the writes is not enough by itself: the buffers tensorstore frees stay cached in
glibc's per-thread arenas (and glibc raises its mmap threshold once a large block is freed, so
ever larger blocks are cached). On the 407 MB test checkpoint that cache, not the data in
flight, was most of the growth: 150-180 MB with the bounded writes alone, 73-82 MB with a
1 MiB threshold, 36 MB with 32 KiB and one 8 MiB box in flight. `return_large_frees_to_os`
pins the threshold so that freed buffers of 32 KiB or more go back to the OS. It changes the
whole process for good, so the conversion CLI (`python -m moetext.convert`) calls it, not the
library function.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import ctypes.util
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

Box = tuple[slice, ...]
# The running save's gate on in-flight boxes (set by BoundedNumpyHandler._background_serialize).
_GATE: contextvars.ContextVar[asyncio.Semaphore | None] = contextvars.ContextVar(
    "moetext_bounded_save_gate", default=None
)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_large_frees_to_os(threshold: int = 32 * 2**10) -> bool:
    """For the rest of the process, glibc serves blocks of >= `threshold` bytes with mmap, so
    that freeing one returns it to the OS at once (a fixed threshold also turns off glibc's
    raising of it). Returns False (and changes nothing) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))


def chunk_boxes(
    shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int, max_bytes: int
) -> Iterator[Box]:
    """Boxes that tile an array of `shape` in C order, each a union of whole chunks (the last
    along an axis may be cut by the array's edge) and at most `max_bytes`, unless one chunk is
    larger: then one chunk per box. Leading axes are split first, so a box is contiguous in
    a C-ordered source wherever it spans whole trailing axes."""
    if len(chunks) != len(shape) or any(c < 1 for c in chunks):
        raise ValueError(f"chunk shape {chunks} does not fit array shape {shape}")

    def boxes(prefix: Box, outer: int, axis: int) -> Iterator[Box]:
        # `outer`: the box's extent over the axes before `axis` (fixed by `prefix`).
        if axis == len(shape):
            yield prefix
            return
        row = outer * math.prod(shape[axis + 1 :]) * itemsize  # bytes per index along `axis`
        step = chunks[axis]
        if step * row > max_bytes and axis + 1 < len(shape):
            for s in range(0, shape[axis], step):
                part = slice(s, min(s + step, shape[axis]))
                yield from boxes((*prefix, part), outer * (part.stop - s), axis + 1)
            return
        step = max(step, max_bytes // row // step * step)
        rest = (slice(None),) * (len(shape) - axis - 1)
        for s in range(0, shape[axis], step):
            yield (*prefix, slice(s, min(s + step, shape[axis])), *rest)

    if 0 not in shape:
        yield from boxes((), 1, 0)


class BoundedNumpyHandler(ocp.type_handlers.NumpyHandler):  # type: ignore[misc]
    """`NumpyHandler` that writes from the source arrays directly (no defensive copy: the
    caller must not change them during the save) with at most `slots` x `box_bytes` in flight."""

    def __init__(self, *, box_bytes: int, slots: int) -> None:
        super().__init__(deepcopy_host_arrays=False)
        if box_bytes < 1 or slots < 1:
            raise ValueError(f"box_bytes={box_bytes} and slots={slots} must be >= 1")
        self.box_bytes = box_bytes
        self.slots = slots

    async def _background_serialize(self, *args: Any, **kwargs: Any) -> None:
        # One gate per save: the write coroutines orbax starts from here (as tasks, which copy
        # this context) all see it, and a concurrent save on another loop has its own.
        token = _GATE.set(asyncio.Semaphore(self.slots))
        try:
            await super()._background_serialize(*args, **kwargs)
        finally:
            _GATE.reset(token)

    async def _open_and_write(
        self, value: np.ndarray, tspec: dict[str, Any], ts_context: ts.Context
    ) -> None:
        t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
        grid = t.chunk_layout.write_chunk.shape if value.ndim else ()
        if grid is None or any(c is None for c in grid):
            raise ValueError(f"no write chunk shape in the tensorstore spec {tspec}")
        chunks = tuple(int(c) for c in grid if c is not None)
        gate = _GATE.get()
        if gate is None:
            raise RuntimeError("BoundedNumpyHandler._open_and_write ran outside a save")
        for box in chunk_boxes(value.shape, chunks, value.dtype.itemsize, self.box_bytes):
            async with gate:
                await t[box].write(value[box], can_reference_source_data_indefinitely=True)
