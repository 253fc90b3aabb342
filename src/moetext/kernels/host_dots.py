"""Whether this host's CPU multiplies bfloat16 natively, and what a CPU matmul should take.

XLA:CPU runs a bfloat16 x bfloat16 -> float32 dot through YNNPACK, which is fast where the CPU
has bfloat16 dot instructions (x86 AMX-BF16 or AVX512-BF16, Arm's BF16 extension) and converts
the operands block by block where it has not (an AVX2 x86, for example): there the same dot
with float32 operands is faster (1024 x 256 x 32000 on a 2-core AVX2 EPYC: 98 against 82
GFLOP/s; docs/performance.md). A bfloat16 operand widens to float32 exactly, and the product
of two bfloat16 values is exact in float32, so a float32 dot of the widened operands is the
bfloat16 dot with float32 accumulation, up to the order of the sums.

    if upcast_bf16_dots(x.dtype):      # True only on a CPU without bfloat16 dot instructions
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)

The environment variable MOETEXT_CPU_BF16_DOTS=native (keep bfloat16 operands) or =widen
(widen them) overrides the detection, for a host whose /proc/cpuinfo hides its flags (some
VMs) or to compare the two (docs/performance.md).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess

import jax
import jax.numpy as jnp

from moetext.kernels.pallas import target

ENV = "MOETEXT_CPU_BF16_DOTS"
# /proc/cpuinfo flags (x86 "flags", Arm "Features") that give bfloat16 dot products.
NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})


def native_bf16_from_cpuinfo(cpuinfo: str) -> bool:
    """Whether a Linux /proc/cpuinfo text names a bfloat16 dot instruction set."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and NATIVE_BF16_FLAGS & set(value.split()):
            return True
    return False


def native_bf16_dots() -> bool:
    """Whether this host's CPU has bfloat16 dot instructions: MOETEXT_CPU_BF16_DOTS when set
    (native or widen), else read from /proc/cpuinfo on Linux and from sysctl
    hw.optional.arm.FEAT_BF16 on macOS; True where neither answers (the bfloat16 dot is then
    kept, as everywhere before this check)."""
    forced = os.environ.get(ENV, "")
    if forced:
        if forced not in ("native", "widen"):
            raise ValueError(f"{ENV}={forced!r}: expected native or widen (or unset: detect)")
        return forced == "native"
    return _detected()


@functools.cache
def _detected() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return native_bf16_from_cpuinfo(f.read())
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            )
            return out.stdout.strip() == "1"
        except (OSError, subprocess.SubprocessError):
            pass
    return True


def upcast_bf16_dots(dtype: jnp.dtype | type) -> bool:
    """Whether a matmul traced now with `dtype` operands should take them as float32: the
    operands are bfloat16, the code runs on this process's CPU (not on, nor compiled ahead of
    time for, an accelerator), and the CPU has no bfloat16 dot instructions."""
    return (
        jnp.dtype(dtype) == jnp.bfloat16
        and not target.tpu_code()
        and jax.default_backend() == "cpu"
        and not native_bf16_dots()
    )
