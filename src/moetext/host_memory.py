"""Host memory: make glibc's malloc keep and reuse the large buffers XLA:CPU frees every step.

XLA:CPU allocates each program execution's buffers with `posix_memalign`: one temporary arena
per call (243 MB for bench-tiny-moe's gradient program) and its outputs (the gradients, the new
parameters and moments: 92 MB each in f32). By default glibc serves every request above its mmap
threshold (at most 32 MiB) with a fresh `mmap` and returns it with `munmap` on free; XLA's
worker threads allocate from their own arenas, which cannot hold anything larger than 64 MiB
and then `mmap` regardless. So every step the kernel maps, faults in and zeroes the same few
hundred megabytes again: ~88,000 minor page faults and ~200 ms of system time per
bench-tiny-moe step on a 2-core host, a sixth of its CPU time (docs/performance.md).

`reuse_freed_memory` sets three `mallopt` parameters before XLA's threads exist:

- `M_ARENA_MAX = 1`: every thread allocates from the main arena, which grows with `brk`;
- `M_MMAP_MAX = 0`: no request is served by `mmap`, so large blocks land in that arena and are
  reused from its free lists once freed;
- `M_TRIM_THRESHOLD = 2 GiB - 1` (the largest `mallopt` takes): free memory at the top of the
  heap is kept up to that size instead of being returned to the kernel after each step.

The price is the one every caching allocator pays (XLA's own on TPU and GPU, tcmalloc,
jemalloc): the process keeps the memory of its peak step instead of handing it back between
steps, and more than that: glibc's `posix_memalign` asks for the block plus its alignment
slack, so a freed block of exactly the size asked for again does not fit until it merges with
its neighbours, and the heap grows a few times before it settles. Measured
(docs/performance.md): bench-tiny-moe's step in scripts/bench_train.py peaks at 1.69 GB
resident instead of 1.38 GB; a program freeing one 128 MB output per call settled after 5-35
calls holding 0.5-1.1 GB of free heap. Nothing computed changes.

The trainer's entry point (`python -m train`, src/train.py) and scripts/bench_train.py call it
before XLA's thread pool exists (created when JAX first initializes a backend): glibc fixes its
arena limit when a second thread first needs an arena, and importing JAX and numpy first still
leaves it in force (the test does so). `MOETEXT_REUSE_HOST_MEMORY=0` leaves glibc's defaults.
It is a no-op where the C library has no `mallopt` (musl, macOS). tests/test_host_memory.py
counts a jitted program's page faults with and without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# mallopt takes an int: 2 GiB - 1 is the largest heap top it can be told to keep.
TRIM_THRESHOLD = 2**31 - 1

ENV = "MOETEXT_REUSE_HOST_MEMORY"
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")

_applied: bool | None = None


def reuse_freed_memory() -> bool:
    """Applies the mallopt settings above once per process; True if they are in force.

    False when `MOETEXT_REUSE_HOST_MEMORY=0`, on a C library without `mallopt`, or when glibc
    refused a setting."""
    global _applied
    if _applied is not None:
        return _applied
    flag = os.environ.get(ENV, "1").strip().lower()
    if flag not in ON + OFF:
        raise ValueError(f"{ENV}={flag!r}: expected 1 (the default: reuse freed host memory) or 0")
    _applied = False
    if flag in OFF:
        return False
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; a refused setting leaves that parameter at its default.
    ok = [
        mallopt(p, v)
        for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    ]
    _applied = all(r == 1 for r in ok)
    return _applied
