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

Where the operands stay bfloat16 on this CPU (`bf16_dots_on_this_cpu`), one form still falls
off YNNPACK: a contraction over the major dim of both operands (x.T @ y with x, y row-major)
goes to Eigen, which has no bfloat16 kernel. The token-chunked loss's dW therefore multiplies
a materialized transpose of x, row-major (program/loss.py: 121 -> 382 GFLOP/s per chunk on an
AVX512-BF16 EPYC).

The environment variable MOETEXT_CPU_BF16_DOTS=native (keep bfloat16 operands) or =widen
(widen them) overrides the detection, for a host whose /proc/cpuinfo hides its flags (some
VMs) or to compare the two (docs/performance.md).

The blocked grouped matmul (kernels/gmm/blocked.py) asks a second question, `widen_gmm_tiles()`:
whether this CPU is AVX2-class, with neither bfloat16 dot instructions nor AVX-512. There the
gmm's per-tile products run faster in another form: the forward and dlhs tiles with float32
operands (YNNPACK's float32 dot, as for the head above), and the weight gradient's
x_tile.T @ y_tile as one row contraction of float32 tiles, which XLA:CPU runs with its own dot
(Eigen, built by jaxlib for AVX2) instead of slicing a transposed copy of x for YNNPACK
(M=32768, K=1024, N=384 over 128 Dirichlet-sized experts on a 2-core AVX2 EPYC: fwd+bwd
1.35-1.41x -> 1.07-1.08x an equal-FLOP dense matmul; docs/performance.md). On an AVX-512 or
bfloat16 host YNNPACK has the wider kernels and the gmm keeps its operands as given.
MOETEXT_CPU_GMM_DOTS=widen or =native overrides that detection the same way.
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


GMM_ENV = "MOETEXT_CPU_GMM_DOTS"
# x86 flags of the vector sets wider than AVX2 whose dot kernels YNNPACK picks at run time.
WIDE_VECTOR_FLAGS = frozenset({"avx512f"})


def cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags a Linux /proc/cpuinfo text lists (x86 "flags", Arm "Features")."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def native_bf16_from_cpuinfo(cpuinfo: str) -> bool:
    """Whether a Linux /proc/cpuinfo text names a bfloat16 dot instruction set."""
    return bool(NATIVE_BF16_FLAGS & cpuinfo_flags(cpuinfo))


def avx2_class_from_cpuinfo(cpuinfo: str) -> bool:
    """Whether a Linux /proc/cpuinfo text describes an AVX2 x86 with neither AVX-512 nor
    bfloat16 dot instructions."""
    flags = cpuinfo_flags(cpuinfo)
    return "avx2" in flags and not (flags & (WIDE_VECTOR_FLAGS | NATIVE_BF16_FLAGS))


def _forced(env: str) -> bool | None:
    """True for env=native, False for =widen, None when unset."""
    forced = os.environ.get(env, "")
    if not forced:
        return None
    if forced not in ("native", "widen"):
        raise ValueError(f"{env}={forced!r}: expected native or widen (or unset: detect)")
    return forced == "native"


def native_bf16_dots() -> bool:
    """Whether this host's CPU has bfloat16 dot instructions: MOETEXT_CPU_BF16_DOTS when set
    (native or widen), else read from /proc/cpuinfo on Linux and from sysctl
    hw.optional.arm.FEAT_BF16 on macOS; True where neither answers (the bfloat16 dot is then
    kept, as everywhere before this check)."""
    forced = _forced(ENV)
    return _detected() if forced is None else forced


@functools.cache
def _cpuinfo() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return None


@functools.cache
def _detected() -> bool:
    cpuinfo = _cpuinfo()
    if cpuinfo is not None:
        return native_bf16_from_cpuinfo(cpuinfo)
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


def _traced_for_this_cpu() -> bool:
    """Whether code traced now runs on this process's CPU (not on, nor compiled ahead of time
    for, an accelerator)."""
    return not target.tpu_code() and jax.default_backend() == "cpu"


def upcast_bf16_dots(dtype: jnp.dtype | type) -> bool:
    """Whether a matmul traced now with `dtype` operands should take them as float32: the
    operands are bfloat16, the code runs on this process's CPU, and the CPU has no bfloat16
    dot instructions."""
    return jnp.dtype(dtype) == jnp.bfloat16 and _traced_for_this_cpu() and not native_bf16_dots()


def bf16_dots_on_this_cpu(dtype: jnp.dtype | type) -> bool:
    """Whether a matmul traced now with `dtype` operands runs them as bfloat16 on this
    process's CPU: bfloat16 operands, CPU code, and a CPU with bfloat16 dot instructions (so
    `upcast_bf16_dots` keeps them). XLA:CPU gives YNNPACK's bfloat16 dot only row-major forms
    that contract the lhs's minor dim; a contraction over both operands' major dim goes to
    Eigen, which has no bfloat16 kernel (program/loss.py's dW, docs/performance.md)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and _traced_for_this_cpu() and native_bf16_dots()


def widen_gmm_tiles() -> bool:
    """Whether the blocked gmm traced now should take its per-tile dots in float32 and its
    weight gradient as row contractions (module docstring): the code runs on this process's
    CPU and that CPU is AVX2-class (MOETEXT_CPU_GMM_DOTS when set, else /proc/cpuinfo; False
    where it cannot be read)."""
    if not _traced_for_this_cpu():
        return False
    forced = _forced(GMM_ENV)
    if forced is not None:
        return not forced
    cpuinfo = _cpuinfo()
    return cpuinfo is not None and avx2_class_from_cpuinfo(cpuinfo)
