"""The kernels seam itself: the GmmBackend protocol, the Recipe protocol and registry, the Gmm op.

A backend written here from nothing but the two forward methods gets gradients (the identity
recipe's custom_vjp) and FP8 (the recipes' default path for backends without scaled kernels);
a recipe written here is one class and one registry line away from a config. Numerics against
the float64 oracles with the tolerance rule of tests/kernels/shapes.py.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shapes import assert_gmm_close

from moetext.kernels import build_gmm
from moetext.kernels.gmm import (
    Gmm,
    GmmBackend,
    NoQuantization,
    Recipe,
    available_backends,
    get_backend,
    gmm_reference,
    tgmm_reference,
)
from moetext.kernels.quant import (
    Fp8Blockwise,
    available_recipes,
    make_recipe,
    registry,
    scaled_kernels_for,
)
from moetext.kernels.quant import fp8_reference as fp8_ref

M, K, N, L, OFFSET = 64, 48, 40, 3, 1
SIZES = [10, 20, 0, 25]  # window = groups 1..3: rows 10..54


def _data(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _check_gmm(out, lhs, rhs, what, transpose=False):
    """out against the float64 oracle, within the f32 summation bound over K."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    kw = dict(group_offset=OFFSET, transpose_rhs=transpose)
    want, mag = (gmm_reference(a, b, SIZES, **kw) for a, b in ((lhs, rhs), (abs(lhs), abs(rhs))))
    assert_gmm_close(out, want, mag, lhs.shape[1], jnp.float32, what)


def _check_tgmm(out, lhs, rhs, what):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    kw = dict(num_groups=L, group_offset=OFFSET)
    want, mag = (tgmm_reference(a, b, SIZES, **kw) for a, b in ((lhs, rhs), (abs(lhs), abs(rhs))))
    assert_gmm_close(out, want, mag, max(SIZES), jnp.float32, what)


@dataclasses.dataclass(frozen=True)
class DenseMaskBackend(GmmBackend):
    """A backend from nothing but the protocol: every group as a masked dense matmul."""

    name: ClassVar[str] = "dense_mask"

    def gmm(self, lhs, rhs, group_sizes, call):
        w = jnp.swapaxes(rhs, 1, 2) if call.transpose_rhs else rhs
        rows = self._rows(group_sizes, call.group_offset, w.shape[0], lhs.shape[0])  # [L, M]
        out = jnp.einsum("lm,mk,lkn->mn", rows, lhs.astype(jnp.float32), w.astype(jnp.float32))
        return out.astype(call.out_dtype)

    def tgmm(self, lhs, rhs, group_sizes, call):
        rows = self._rows(group_sizes, call.group_offset, call.num_groups, lhs.shape[0])
        out = jnp.einsum("lm,mk,mn->lkn", rows, lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        return out.astype(call.out_dtype)

    @staticmethod
    def _rows(group_sizes, group_offset, num_local, m):
        ends = jnp.cumsum(group_sizes)
        g = jnp.searchsorted(ends, jnp.arange(m), side="right") - group_offset
        return (g[None, :] == jnp.arange(num_local)[:, None]).astype(jnp.float32)


def test_the_protocol_is_declared_and_backends_compare_by_value():
    class Half(GmmBackend):  # tgmm missing: not a backend
        name = "half"

        def gmm(self, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract"):
        Half()
    for name in available_backends():
        be = get_backend(name)
        assert isinstance(be, GmmBackend) and be.name == name
        assert be == get_backend(name) and hash(be) == hash(get_backend(name))
        # Only pallas_tpu has fused kernels for scaled operands (paired in quant/).
        assert (scaled_kernels_for(be) is not None) == (name == "pallas_tpu"), name


def test_a_new_backend_gets_gradients_and_every_recipe():
    be = DenseMaskBackend()
    x, w, dy = _data((M, K), 0), _data((L, K, N), 1), _data((M, N), 2)
    gs = jnp.asarray(SIZES, jnp.int32)
    op = Gmm(be)
    out, vjp = jax.vjp(lambda x, w: op(x, w, gs, group_offset=OFFSET), x, w)
    dx, dw = vjp(dy)
    _check_gmm(out, x, w, "out")
    _check_gmm(dx, dy, w, "dlhs", transpose=True)
    _check_tgmm(dw, x, dy, "drhs")
    # Block-wise FP8 with no scaled kernels: the dequantized operands through be.gmm, which is
    # the FP8 oracle (float32 accumulation of exact products: 1e-5 of max|oracle|).
    fp8_out = Gmm(be, Fp8Blockwise())(x, w, gs, group_offset=OFFSET)
    q = lambda a, axis: fp8_ref.quantize_reference(np.asarray(a), axis=axis)
    want = fp8_ref.gmm_fp8_reference(*q(x, 1), *q(w, 1), SIZES, group_offset=OFFSET)
    np.testing.assert_allclose(fp8_out, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # Every registered recipe runs on it, forward and backward.
    for name in available_recipes():
        op = build_gmm(be, name)
        _, vjp = jax.vjp(lambda x, w, op=op: op(x, w, gs, group_offset=OFFSET), x, w)
        assert all(np.isfinite(np.asarray(g)).all() for g in vjp(dy)), name


@dataclasses.dataclass(frozen=True)
class Bf16Operands(Recipe):
    """A recipe in a dozen lines: both operands rounded to bfloat16, f32 accumulation."""

    name: ClassVar[str] = "bf16_operands"

    def gmm(self, backend, lhs, rhs, group_sizes, call):
        bf = jnp.bfloat16
        return NoQuantization().gmm(backend, lhs.astype(bf), rhs.astype(bf), group_sizes, call)

    def tgmm(self, backend, lhs, rhs, group_sizes, call):
        bf = jnp.bfloat16
        return NoQuantization().tgmm(backend, lhs.astype(bf), rhs.astype(bf), group_sizes, call)


def test_a_new_recipe_is_a_class_and_a_registry_line(monkeypatch):
    monkeypatch.setattr(registry, "_RECIPES", dict(registry._RECIPES))
    registry.register_recipe(Bf16Operands)
    assert "bf16_operands" in available_recipes()
    op = build_gmm("ragged_dot", "bf16_operands")
    assert op.name == "bf16_operands[ragged_dot]" and op.fuse_gate_up  # auto: it quantizes
    x, w = _data((M, K), 3), _data((L, K, N), 4)
    gs = jnp.asarray(SIZES, jnp.int32)
    out = op(x, w, gs, group_offset=OFFSET, preferred_element_type=jnp.float32)
    _check_gmm(out, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), "bf16 operands")
    dx, dw = jax.grad(lambda x, w: jnp.sum(op(x, w, gs, group_offset=OFFSET)), (0, 1))(x, w)
    assert dx.dtype == dw.dtype == jnp.float32


def test_recipe_registry_errors_name_the_nearest():
    assert {"none", "fp8_blockwise", "fp8_tensorwise"} <= set(available_recipes())
    assert make_recipe("none") == NoQuantization()
    with pytest.raises(ValueError, match=r"'fp8_blokwise' \(did you mean 'fp8_blockwise'\?\)"):
        make_recipe("fp8_blokwise")
    with pytest.raises(ValueError, match=r"recipe 'none' has no option 'qag'; it takes no options"):
        make_recipe("none", {"qag": True})
    with pytest.raises(ValueError, match=r"no option 'weight_blocks' \(did you mean 'weight_bl"):
        make_recipe("fp8_blockwise", {"weight_blocks": "1x128"})

    class Loose(Recipe):  # options must be dataclass fields
        name = "loose"

    with pytest.raises(TypeError, match="must be a dataclass"):
        registry.register_recipe(Loose)


def test_build_gmm_resolves_options_once():
    op = build_gmm("blocked", "fp8_blockwise", {"qag": True}, grad_reduce_dtype=jnp.bfloat16)
    assert op == Gmm(
        get_backend("blocked"),
        Fp8Blockwise(qag=True),
        grad_reduce_dtype="bfloat16",
        fuse_gate_up=True,
    )
    assert hash(op) == hash(
        build_gmm("blocked", "fp8_blockwise", {"qag": True}, grad_reduce_dtype="bfloat16")
    )
    plain = build_gmm("blocked")
    assert plain.name == "blocked" and not plain.fuse_gate_up and plain.recipe == NoQuantization()
    assert build_gmm("blocked", fuse_gate_up=True).fuse_gate_up
    assert build_gmm("blocked", tiling=[128, 256, 512]).tiling == (128, 256, 512)
    with pytest.raises(ValueError, match=r"tiling must be three positive ints"):
        build_gmm("blocked", tiling=(128, 0, 128))
    with pytest.raises(ValueError, match=r"unknown gmm backend 'nope'"):
        build_gmm("nope")
