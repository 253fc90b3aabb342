"""The public gmm/tgmm api: input checks, the runtime check, backend resolution, dtypes.

Legend: M rows, K contraction, N outputs, G groups.

Numerics of every backend are in the per-backend modules (gmm_suite); this module checks what
the api itself promises. The "reference" backend is used where a backend must run because it
compiles fastest; exact equality is used where the api only routes values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetext.kernels import gmm as gmm_lib
from moetext.kernels.gmm import gmm, gmm_reference, tgmm

X_MK = jnp.ones((10, 4), jnp.float32)
W_GKN = jnp.ones((2, 4, 3), jnp.float32)
GS = jnp.asarray([4, 6], jnp.int32)


# The `type: ignore[arg-type]` calls below are mistakes mypy also rejects; they test the
# runtime check that catches them for untyped callers.
@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: gmm(jnp.ones((2, 10, 4)), W_GKN, GS),
            r"lhs must be rank 2, got shape \(2, 10, 4\)",
        ),
        (
            lambda: gmm(X_MK, jnp.ones((4, 3)), GS),
            r"rhs must be \[G, K, N\] \(rank 3\), got shape \(4, 3\)",
        ),
        (
            lambda: gmm(X_MK, jnp.ones((2, 5, 3)), GS),
            r"lhs \(10, 4\) has K=4 but rhs \(2, 5, 3\) read as \[G, K, N\] has K=5",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, transpose_rhs=True),
            r"read as \[G, N, K\] \(transpose_rhs=True\) has K=3",
        ),
        (
            lambda: gmm(X_MK, jnp.ones((3, 4, 3)), GS),
            r"3 groups in the weights but group_sizes has 2",
        ),
        (
            lambda: gmm(X_MK, jnp.ones((3, 4, 3)), GS, group_offset=0),
            r"3 local groups exceed the 2",
        ),
        (
            lambda: gmm(X_MK, W_GKN, jnp.asarray([4.0, 6.0])),
            r"group_sizes must be integer, got dtype float32",
        ),
        (
            lambda: gmm(X_MK, W_GKN, jnp.ones((2, 1), jnp.int32)),
            r"group_sizes must be rank 1 \[G\], got shape \(2, 1\)",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, group_offset=jnp.zeros(2, jnp.int32)),
            r"group_offset must be a scalar, got shape \(2,\)",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, tiling=(128, 128)),  # type: ignore[arg-type]
            r"tiling must be three positive ints \(tm, tk, tn\), got \(128, 128\)",
        ),
        (lambda: gmm(X_MK, W_GKN, GS, tiling=(0, 128, 128)), r"got \(0, 128, 128\)"),
        (
            lambda: gmm(X_MK, W_GKN, GS, existing_out=jnp.ones((10, 4))),
            r"existing_out must be \(10, 3\), got \(10, 4\)",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, group_offset=0, rows_covered=True),
            r"rows_covered=True needs every group local and no existing_out; got 2 local of 2 "
            r"groups, group_offset=given",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, existing_out=jnp.ones((10, 3)), rows_covered=True),
            r"rows_covered=True needs .*existing_out=given",
        ),
        (
            lambda: tgmm(X_MK, jnp.ones((9, 3)), GS),
            r"lhs \(10, 4\) and rhs \(9, 3\) must have the same rows M",
        ),
        (lambda: tgmm(X_MK, jnp.ones((10,)), GS), r"tgmm: rhs must be rank 2, got shape \(10,\)"),
        (
            lambda: tgmm(X_MK, jnp.ones((10, 3)), GS, num_groups=3),
            r"3 groups in the weights but group_sizes has 2",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, backend="nope"),
            r"unknown gmm backend 'nope'; valid names: auto, .*blocked.*ragged_dot.*reference",
        ),
        (
            lambda: gmm(X_MK, W_GKN, GS, backend=3),  # type: ignore[arg-type]
            r"backend must be a name or a GmmBackend, got int",
        ),
    ],
)
def test_user_mistakes_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("bad", [[-1, 6], [6, 6]], ids=["negative", "sum_over_m"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_checked_raises_on_bad_group_sizes(bad, jit):
    def f(gs):
        return gmm(X_MK, W_GKN, gs, backend="reference", checked=True)

    f = jax.jit(f) if jit else f
    # Eagerly the callback's ValueError surfaces as is; under jit XLA wraps it in a runtime error.
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="sum to at most M=10"):
        jax.block_until_ready(f(jnp.asarray(bad, jnp.int32)))
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="sum to at most M=10"):
        jax.block_until_ready(
            tgmm(
                X_MK,
                jnp.ones((10, 3)),
                jnp.asarray(bad, jnp.int32),
                backend="reference",
                checked=True,
            )
        )


def test_checked_passes_valid_sizes_and_plain_inputs_are_accepted():
    # Python lists / NumPy arrays are accepted and mean the same as jax arrays.
    out = gmm(
        np.ones((10, 4), np.float32),
        np.ones((2, 4, 3), np.float32),
        [4, 5],
        checked=True,
        backend="reference",
    )
    np.testing.assert_array_equal(out, gmm_reference(np.ones((10, 4)), np.ones((2, 4, 3)), [4, 5]))


def test_auto_backend_is_blocked_on_cpu_and_names_resolve():
    assert gmm_lib.auto_backend_name("cpu") == "blocked"
    assert gmm_lib.get_backend("auto").name == "blocked"
    for name in gmm_lib.available_backends():
        be = gmm_lib.get_backend(name)
        assert isinstance(be, gmm_lib.GmmBackend) and be.name == name
    assert {"blocked", "ragged_dot", "reference"} <= set(gmm_lib.available_backends())


def test_preferred_element_type_sets_output_dtype():
    x = jnp.ones((10, 4), jnp.bfloat16)
    w = jnp.ones((2, 4, 3), jnp.bfloat16)
    assert gmm(x, w, GS, backend="reference").dtype == jnp.bfloat16
    assert (
        gmm(x, w, GS, backend="reference", preferred_element_type=jnp.float32).dtype == jnp.float32
    )
    dw = tgmm(
        x,
        jnp.ones((10, 3), jnp.bfloat16),
        GS,
        backend="reference",
        preferred_element_type=jnp.float32,
    )
    assert dw.dtype == jnp.float32 and dw.shape == (2, 4, 3)
    # Gradients come back in the input dtypes whatever the output dtype.
    dx, dw = jax.grad(
        lambda a, b: gmm(a, b, GS, backend="reference", preferred_element_type=jnp.float32).sum(),
        argnums=(0, 1),
    )(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


def test_local_row_mask_marks_the_window_rows():
    gs = jnp.asarray([2, 0, 3, 1], jnp.int32)
    got = gmm_lib.local_row_mask(gs, jnp.int32(1), 2, 8)
    np.testing.assert_array_equal(got, [False, False, True, True, True, False, False, False])
