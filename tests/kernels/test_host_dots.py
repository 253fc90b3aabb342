"""kernels/host_dots.py: which CPUs multiply bfloat16 natively, and when a CPU matmul widens its
bfloat16 operands to float32."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moetext.kernels import host_dots
from moetext.kernels.pallas.target import compiling_for

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
NEOVERSE_V1 = "Features\t: fp asimd sve bf16 i8mm\n"
ICE_LAKE = "flags\t\t: avx2 fma avx512f avx512bw avx512_vnni\n"


def test_cpuinfo_names_the_bf16_dot_instructions():
    assert not host_dots.native_bf16_from_cpuinfo(AVX2_EPYC)
    assert host_dots.native_bf16_from_cpuinfo(SAPPHIRE_RAPIDS)
    assert host_dots.native_bf16_from_cpuinfo(NEOVERSE_V1)
    assert not host_dots.native_bf16_from_cpuinfo("model name\t: bf16 in a name, not a flag\n")


def test_the_environment_overrides_the_detection(monkeypatch):
    monkeypatch.setenv(host_dots.ENV, "widen")
    assert not host_dots.native_bf16_dots()
    monkeypatch.setenv(host_dots.ENV, "native")
    assert host_dots.native_bf16_dots()
    monkeypatch.setenv(host_dots.ENV, "fast")
    with pytest.raises(ValueError, match="MOETEXT_CPU_BF16_DOTS='fast': expected native or widen"):
        host_dots.native_bf16_dots()


def test_only_bf16_on_a_cpu_without_bf16_dots_widens(monkeypatch):
    monkeypatch.setattr(host_dots, "native_bf16_dots", lambda: False)
    assert host_dots.upcast_bf16_dots(jnp.bfloat16)
    assert not host_dots.upcast_bf16_dots(jnp.float32)
    with compiling_for("v6e"):  # code compiled for a TPU keeps its bf16 operands
        assert not host_dots.upcast_bf16_dots(jnp.bfloat16)
    monkeypatch.setattr(host_dots, "native_bf16_dots", lambda: True)
    assert not host_dots.upcast_bf16_dots(jnp.bfloat16)


def test_bf16_dots_on_this_cpu_only_where_bf16_operands_are_kept(monkeypatch):
    monkeypatch.setattr(host_dots, "native_bf16_dots", lambda: True)
    assert host_dots.bf16_dots_on_this_cpu(jnp.bfloat16)
    assert not host_dots.bf16_dots_on_this_cpu(jnp.float32)
    with compiling_for("v6e"):  # code compiled for a TPU is not this CPU's
        assert not host_dots.bf16_dots_on_this_cpu(jnp.bfloat16)
    monkeypatch.setattr(host_dots, "native_bf16_dots", lambda: False)  # widened instead
    assert not host_dots.bf16_dots_on_this_cpu(jnp.bfloat16)


def test_widened_operands_give_the_bf16_dot():
    # bf16 -> f32 is exact and so is a product of two bf16 values in f32: the widened dot is the
    # bf16 dot with f32 accumulation up to the order of its sums (K = 512 terms: measured
    # <= 2.4e-7 of the largest |entry|; bound 1e-5 of it).
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((512, 96)), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))
    narrow = lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    wide = lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    for got in (narrow, wide):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_avx2_class_is_avx2_without_wider_or_bf16_dots():
    assert host_dots.avx2_class_from_cpuinfo(AVX2_EPYC)
    for other in (ICE_LAKE, SAPPHIRE_RAPIDS, NEOVERSE_V1, ""):
        assert not host_dots.avx2_class_from_cpuinfo(other)


def test_widen_gmm_tiles_follows_the_cpu_and_its_override(monkeypatch):
    monkeypatch.delenv(host_dots.GMM_ENV, raising=False)
    for cpuinfo, want in ((AVX2_EPYC, True), (ICE_LAKE, False), (None, False)):
        monkeypatch.setattr(host_dots, "_cpuinfo", lambda c=cpuinfo: c)
        assert host_dots.widen_gmm_tiles() is want
        monkeypatch.setenv(host_dots.GMM_ENV, "native")
        assert not host_dots.widen_gmm_tiles()
        monkeypatch.setenv(host_dots.GMM_ENV, "widen")
        assert host_dots.widen_gmm_tiles()
        with compiling_for("v6e"):  # code compiled for a TPU is not this CPU's
            assert not host_dots.widen_gmm_tiles()
        monkeypatch.delenv(host_dots.GMM_ENV)
    monkeypatch.setenv(host_dots.GMM_ENV, "eigen")
    with pytest.raises(ValueError, match="MOETEXT_CPU_GMM_DOTS='eigen': expected native or widen"):
        host_dots.widen_gmm_tiles()
