"""dot_rows: a few rows times a 2-D weight, as the decode step runs its head and experts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moetext.models.layers.rowdot import dot_rows


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("w_contract", [0, 1])
def test_dot_rows_equals_the_float64_product(m, w_contract):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, 24))
    w = rng.standard_normal((24, 40) if w_contract == 0 else (40, 24))
    want = x @ (w if w_contract == 0 else w.T)
    got = dot_rows(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(w, jnp.float32),
        w_contract=w_contract,
        dtype=jnp.float32,
        out_dtype=jnp.float32,
    )
    assert got.shape == (m, 40) and got.dtype == jnp.float32
    # float32 operands, K = 24: a few ulps of the largest product.
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


def test_bf16_single_row_matches_a_bf16_output_dot():
    """Rounded to bf16 like a dot whose output dtype is bf16 (what the model's __call__ does)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    got = dot_rows(x, w, w_contract=1, dtype=jnp.bfloat16, out_dtype=jnp.float32)
    want = jnp.einsum("md,vd->mv", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    got64 = np.asarray(got, np.float64)
    # Rounded to bf16: every value is one (what a bf16-output dot returns).
    np.testing.assert_array_equal(got64, np.asarray(jnp.asarray(got).astype(jnp.bfloat16), float))
    # The two programs sum the same 64 exact float32 products (bf16 x bf16) in orders XLA:CPU
    # picks per host (vector width): the float32 sums may differ by 2 * 64 * 2^-24 of the sum
    # of |products|, far below one bf16 ulp (2^-7 of the value at most), so each bf16 value is
    # the same or one ulp apart where a sum falls next to a rounding boundary.
    want64 = np.asarray(want.astype(jnp.float32), np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want64), 2.0**-126))) - 7)
    np.testing.assert_array_less(np.abs(got64 - want64), ulp * (1 + 2.0**-10))


def test_a_single_bf16_row_never_converts_the_weight_to_float32():
    """The point of dot_rows on XLA:CPU: the compiled program holds no float32 copy of w."""
    x = jnp.zeros((1, 256), jnp.bfloat16)
    w = jnp.zeros((512, 256), jnp.bfloat16)
    f = jax.jit(
        lambda x, w: dot_rows(x, w, w_contract=1, dtype=jnp.bfloat16, out_dtype=jnp.float32)
    )
    hlo = f.lower(x, w).compile().as_text()
    assert not re.search(r"f32\[(512,256|256,512)\]", hlo), "w was converted to float32"
    naive = jax.jit(lambda x, w: jnp.einsum("md,vd->mv", x, w).astype(jnp.float32))
    if jax.devices()[0].platform == "cpu":  # the behaviour dot_rows works around
        assert re.search(r"f32\[(512,256|256,512)\]", naive.lower(x, w).compile().as_text())


def test_mismatched_shapes_are_named():
    x = jnp.zeros((2, 8))
    with pytest.raises(ValueError, match=r"K=8 but w \(6, 5\) has 6 on axis 0"):
        dot_rows(x, jnp.zeros((6, 5)), w_contract=0, dtype=jnp.float32, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="2-D weight"):
        dot_rows(x, jnp.zeros((8, 5, 1)), w_contract=0, dtype=jnp.float32, out_dtype=jnp.float32)


def test_a_one_token_attention_step_keeps_its_projections_in_bf16():
    """Attention.cached projects q/k/v/o through dot_rows: a one-token decode step compiles
    without a float32 copy of any projection weight ([D, N*H] = [256, 512] and [512, 256],
    [D, K*H] = [256, 128])."""
    from flax import nnx

    from moetext.config.schema import ModelConfig
    from moetext.models.layers.attention import Attention, KVCache
    from moetext.models.layers.rope import rope_cos_sin

    cfg = ModelConfig(
        emb_dim=256,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        param_dtype="bfloat16",
        dtype="bfloat16",
    )
    attn = Attention(cfg, qk_norm=True, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(attn)
    cache = KVCache(*(jnp.zeros((1, 8, 2, 64), jnp.bfloat16) for _ in range(2)))
    cos, sin = rope_cos_sin(jnp.zeros((1, 1), jnp.int32), 64, 10_000.0)
    mask = jnp.ones((1, 1, 8), bool)

    def step(state, x, cache):
        return nnx.merge(graphdef, state).cached(x, cos, sin, cache, jnp.int32(3), mask)

    x = jnp.zeros((1, 1, 256), jnp.bfloat16)
    hlo = jax.jit(step).lower(state, x, cache).compile().as_text()
    copies = re.findall(r"f32\[(?:256,512|512,256|256,128|256,8,64|8,64,256|256,2,64)\]", hlo)
    assert not copies, copies
