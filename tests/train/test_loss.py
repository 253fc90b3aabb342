"""The fused LM head + cross-entropy (program/loss.py), over vocab chunks and over token chunks,
against a float64 oracle, the logits path on a real model, a 40-step training run, and an
8-device mesh.

Legend: T tokens, D emb_dim, V vocab.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fake_devices import run_worker
from moetext import config, models, program
from moetext import data as data_lib
from moetext.data.batch import from_tokens, target_mask
from moetext.kernels.pallas.target import compiling_for
from moetext.program import loss as loss_lib
from moetext.program.loss import (
    chunking,
    fused_masked_nll,
    lm_head_nll,
    masked_nll,
    resolve_chunks,
    token_chunked_nll,
)
from moetext.program.step import make_loss_fn

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/models/tiny-qwen3-moe.yml"
QUIET = ["train.progress_bar=false", "train.peak_tflops=1.0", "checkpoint.enabled=false"]


@pytest.mark.parametrize(
    ("vocab", "chunk", "want"),
    [
        (512, 4096, (1, 512)),  # one chunk
        (32000, 4096, (8, 4000)),  # bench-tiny-moe
        (32000, 2048, (16, 2000)),
        (151936, 4096, (64, 2374)),  # Qwen3: 2^7 x 1187; 38 to 63 chunks do not divide it
        (211, 50, (5, 43)),  # prime: 5 x 43 = 215, the last row of 4 chunks padded
        (100, 7, (20, 5)),
        (7, 1, (7, 1)),
    ],
)
def test_chunking_splits_evenly_when_it_can(vocab, chunk, want):
    n, c = chunking(vocab, chunk)
    assert (n, c) == want
    assert c <= chunk and n * c >= vocab and n * c - vocab < n


@pytest.mark.parametrize(
    ("vocab", "chunk", "want"),
    [
        (151936, 2048, (99, 1536)),  # 128 rows padded; 75 x 2048 would pad 1664
        (32000, 2048, (25, 1280)),  # exact
        (512, 4096, (1, 512)),
        (100, 7, (1, 128)),  # chunk_size below the multiple: one multiple
    ],
)
def test_chunking_in_multiples_pads_the_fewest_rows(vocab, chunk, want):
    # The split_dense_gathers path: chunk rows a multiple of 128 (loss._multiple).
    n, c = chunking(vocab, chunk, 128)
    assert (n, c) == want
    assert c % 128 == 0 and c <= max(chunk, 128) and n * c >= vocab
    assert n <= 2 * -(-vocab // max(chunk // 128 * 128, 128))


def _reference(h_TD, w_VD, targets_T, mask_T):
    """float64: (sum of masked NLL, dloss/dh, dloss/dw, dlogits) from the full logits."""
    h, w = np.asarray(h_TD, np.float64), np.asarray(w_VD, np.float64)
    logits = h @ w.T
    top = logits.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    rows = np.arange(len(targets_T))
    nll = lse - logits[rows, targets_T]
    dlogits = np.exp(logits - lse[:, None])
    dlogits[rows, targets_T] -= 1.0
    dlogits *= mask_T[:, None]
    return (nll * mask_T).sum(), dlogits @ w, dlogits.T @ h, dlogits


# (T, D, V, chunk_size): one chunk; even chunks; V prime (padded rows); more chunks than rows
# per chunk; a chunk of one row.
SHAPES = [(16, 8, 64, 64), (16, 8, 64, 16), (24, 16, 211, 50), (33, 16, 100, 7), (8, 4, 13, 1)]


def _inputs(t, d, v, dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, d)).astype(np.float32)
    # Logits ~ N(0, 3^2): a softmax neither flat nor one-hot.
    w = (3.0 / np.sqrt(d) * rng.standard_normal((v, d))).astype(np.float32)
    targets = rng.integers(0, v, t).astype(np.int32)
    mask = (rng.random(t) < 0.7).astype(np.float32)
    mask[0] = 0.0  # at least one masked token
    return jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(targets), jnp.asarray(mask)


def _fused(h_TD, w_VD, targets_T, mask_T, chunk_size):
    nll_sum, _ = fused_masked_nll(
        h_TD[None], w_VD, targets_T[None], mask_T[None], chunk_size=chunk_size
    )
    return nll_sum


_value_and_grad = jax.jit(jax.value_and_grad(_fused, argnums=(0, 1)), static_argnums=4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-D{}-V{}-c{}".format(*s))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_loss_and_gradients_match_the_float64_oracle(shape, dtype):
    t, d, v, chunk = shape
    h, w, targets, mask = _inputs(t, d, v, dtype)
    result = _value_and_grad(h, w, targets, mask, chunk)
    # This host's choice: dlogits stay float32 where the matmuls widen bf16 operands anyway.
    _check_against_oracle(result, h, w, targets, mask, widened=loss_lib.upcast_bf16_dots(dtype))


def _check_against_oracle(result, h, w, targets, mask, widened):
    loss, (dh, dw) = result
    dtype = h.dtype
    assert dh.dtype == h.dtype and dw.dtype == w.dtype and loss.dtype == jnp.float32
    # The oracle sees the very values the kernel got (bf16 inputs upcast exactly).
    ref_loss, ref_dh, ref_dw, ref_dlogits = _reference(
        np.asarray(h, np.float32), np.asarray(w, np.float32), np.asarray(targets), np.asarray(mask)
    )
    # The forward is float32 throughout (bf16 x bf16 products are exact in f32): only f32
    # rounding of D-term dots and V-term sums (measured <= 1.1e-7 relative). Bound: 1e-5.
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    dh, dw = np.asarray(dh, np.float64), np.asarray(dw, np.float64)
    if dtype == jnp.float32:
        # f32 end to end: each entry within 1e-5 of its tensor's largest (measured <= 5.4e-7).
        for got, ref in ((dh, ref_dh), (dw, ref_dw)):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        return
    # bf16: dlogits are rounded to bf16 for the backward matmuls (as autodiff of the logits path
    # rounds them) and each result is rounded to bf16: two roundings of unit roundoff u = 2^-8.
    # So per entry |error| <= u * (|dlogits| @ |other operand|) + u * |ref|, plus f32
    # accumulation (tiny): a worst-case bound per entry, not a fitted tolerance (the errors
    # reach at most 78% of it). widened (float32 matmuls of the widened operands, a CPU without
    # bf16 dots): dlogits stay float32, so only the result's rounding is left, u * |ref|; the
    # dlogits term would break it (it is most of the bf16 error).
    u = 2.0**-8
    abs_dl = np.abs(ref_dlogits)
    for got, ref, other in (
        (dh, ref_dh, abs_dl @ np.abs(np.asarray(w, np.float64))),
        (dw, ref_dw, abs_dl.T @ np.abs(np.asarray(h, np.float64))),
    ):
        bound = 1.01 * u * ((0 if widened else other) + np.abs(ref)) + 1e-6 * np.abs(ref).max()
        assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)


def _tokens(h_TD, w_VD, targets_T, mask_T):
    return token_chunked_nll(h_TD, w_VD, targets_T, mask_T)


# (T, D, V, tokens per chunk): one chunk; even chunks; padded chunks (33 = 3 x 11, 7 of 4 x 2);
# a chunk of one token.
TOKEN_SHAPES = [(16, 8, 64, 16), (16, 8, 64, 4), (33, 16, 211, 12), (7, 4, 13, 2), (8, 4, 13, 1)]


@pytest.mark.parametrize("shape", TOKEN_SHAPES, ids=lambda s: "T{}-D{}-V{}-t{}".format(*s))
@pytest.mark.parametrize(
    ("dtype", "upcast", "dw_transposed"),
    [
        (jnp.float32, False, False),
        (jnp.bfloat16, False, False),
        (jnp.bfloat16, False, True),
        (jnp.bfloat16, True, False),
    ],
    ids=["f32", "bf16", "bf16-dw-DV", "bf16-upcast"],
)
def test_token_chunks_match_the_float64_oracle(shape, dtype, upcast, dw_transposed, monkeypatch):
    # The gradient formed in the forward, per chunk of tokens over the whole vocabulary: the
    # same oracle and bounds as the vocab chunks (dlogits rounded to bf16 once, each result once;
    # upcast: the bf16 operands widened to f32 first, which changes no product, and dlogits
    # kept float32; dw_transposed: dW accumulated as [D, V] from h's transpose, as on a CPU
    # with bf16 dots). Both forms are forced, so every host runs each.
    t, d, v, per_chunk = shape
    monkeypatch.setattr(loss_lib, "TOKEN_CHUNK_LOGITS_BYTES", per_chunk * v * 4)
    monkeypatch.setattr(loss_lib, "upcast_bf16_dots", lambda dtype: upcast)
    monkeypatch.setattr(loss_lib, "bf16_dots_on_this_cpu", lambda dtype: dw_transposed)
    h, w, targets, mask = _inputs(t, d, v, dtype)
    result = jax.jit(jax.value_and_grad(_tokens, argnums=(0, 1)))(h, w, targets, mask)
    _check_against_oracle(result, h, w, targets, mask, widened=upcast)
    # Without differentiation the primal (one matmul per chunk) gives the same value.
    assert float(jax.jit(_tokens)(h, w, targets, mask)) == pytest.approx(float(result[0]), rel=1e-6)


def test_token_chunks_are_the_cpu_default_and_never_compiled_for_a_tpu():
    assert jax.default_backend() == "cpu"
    assert resolve_chunks("auto") == "tokens" and resolve_chunks("vocab") == "vocab"
    with compiling_for("v5p"):
        assert resolve_chunks("auto") == "vocab" and resolve_chunks("tokens") == "tokens"
        assert not loss_lib.upcast_bf16_dots(jnp.bfloat16)  # TPU code keeps bf16 operands
    with pytest.raises(ValueError, match="auto, vocab, tokens; got 'token'"):
        resolve_chunks("token")


def test_masked_tokens_get_no_gradient_and_the_forward_alone_matches():
    h, w, targets, mask = _inputs(24, 16, 211, jnp.float32)
    loss, (dh, _) = _value_and_grad(h, w, targets, mask, 50)
    assert np.all(np.asarray(dh)[np.asarray(mask) == 0] == 0)
    # Without differentiation the primal (statistics only) runs: the same value.
    nll_T = jax.jit(lm_head_nll, static_argnums=3)(h, w, targets, 50)
    assert float(jnp.sum(nll_T * mask)) == pytest.approx(float(loss), rel=1e-6)


def test_bad_shapes_and_dtypes_are_named():
    h, w, targets, mask = _inputs(8, 4, 13, jnp.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        lm_head_nll(h, w.astype(jnp.bfloat16), targets, 4)
    with pytest.raises(ValueError, match=r"must be \[V, 4\]"):
        fused_masked_nll(h[None], w[:, :3], targets[None], mask[None], chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunking(13, 0)
    with pytest.raises(ValueError, match=r"only D \(dim 1\) of the head can be gathered"):
        lm_head_nll(h, w, targets, 4, ((0, ("fsdp",)),))
    with pytest.raises(ValueError, match="must be \\[T, D\\], \\[V, D\\] of one dtype"):
        token_chunked_nll(h, w.astype(jnp.bfloat16), targets, mask)
    with pytest.raises(ValueError, match=r"weights \(7,\) must be \[8\]"):
        token_chunked_nll(h, w, targets, mask[:7])


def test_the_fused_loss_never_holds_the_full_logits():
    # Compiled temporaries of loss + grads: the logits path holds [T, V] f32 arrays (logits,
    # log-softmax, their gradient); the fused one only [T, C] chunks and the [V, D] gradient.
    t, d, v, chunk = 1024, 64, 8192, 1024
    h, w, targets, mask = _inputs(t, d, v, jnp.bfloat16)

    def logits_path(h, w):
        logits = jnp.einsum("td,vd->tv", h, w).astype(jnp.float32)
        return masked_nll(logits[None], targets[None], mask[None])[0]

    def temp_bytes(f):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        return grad.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    full_logits = t * v * 4
    fused = temp_bytes(lambda h, w: _fused(h, w, targets, mask, chunk))
    assert temp_bytes(logits_path) >= full_logits
    assert fused < full_logits / 2, (fused, full_logits)


def _tiny(extra):
    return config.load(TINY, [*QUIET, "data.kind=synthetic", *extra])


def test_the_fused_path_needs_a_model_with_hidden_states():
    # qwen3_moe (and dense) provide hidden_states/head_VD; a family with only __call__ (like
    # tests/models/test_family.py's, trained there through the real loop) gets the logits path.
    model = nnx.eval_shape(lambda: program.create_model(_tiny([])))
    assert isinstance(model, models.HiddenStatesLM)
    assert model.loss_chunk_size == 8192  # the default

    class LogitsOnly(nnx.Module):
        def __call__(self, tokens_BS, *, positions_BS=None, segment_ids_BS=None):
            raise NotImplementedError

    assert not isinstance(LogitsOnly(), models.HiddenStatesLM)


def test_fused_loss_equals_the_logits_path_on_a_model():
    # tiny-qwen3-moe computes in float32, so both paths run the same f32 products and differ
    # only in summation order (per-chunk logsumexp and dW, chunked dh); measured 7.6e-8
    # relative (loss) and 9.1e-7 of each gradient's largest entry. Bounds: 2e-6 and 1e-5.
    # chunk 100 of V = 512: 8 chunks of 64 rows; token chunks: one chunk of the 64 tokens.
    results = {}
    for chunk, by in ((100, "vocab"), (100, "tokens"), (0, "auto")):
        cfg = _tiny([f"model.loss_chunk_size={chunk}", f"model.loss_chunks={by}"])
        b = program.build(cfg, jax.devices()[:1])
        tokens = np.random.default_rng(0).integers(0, 512, (4, 17)).astype(np.int32)
        batch = from_tokens(tokens)
        # Two documents in row 0 and padding at the end of row 1: masked targets.
        batch["segment_ids"][0, 9:] = 2
        batch["segment_ids"][1, 12:] = 0
        grad_fn = jax.jit(jax.value_and_grad(make_loss_fn(b.graphdef, b.rest), has_aux=True))
        (loss, (ce, _, nll_sum, count)), grads = grad_fn(b.state.params, batch)
        results[by] = (float(loss), float(ce), float(count), jax.device_get(grads))
    plain = results["auto"]
    for fused in (results["vocab"], results["tokens"]):
        assert fused[2] == plain[2] == 4 * 16 - 1 - 5  # the segment boundary, 5 padding targets
        assert fused[0] == pytest.approx(plain[0], rel=2e-6)
        assert fused[1] == pytest.approx(plain[1], rel=2e-6)
        errs = jax.tree.map(
            lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b))), fused[3], plain[3]
        )
        assert max(jax.tree.leaves(errs)) <= 1e-5, errs


def test_training_loss_curve_is_unchanged_by_the_fused_loss():
    # The README's tiny config (packed real text, so masked targets), 40 steps of the trainer's
    # own jitted step from the same initial state and batches: the fused loss as CPU runs it
    # (model.loss_chunks=auto: token chunks) vs logits.
    # float32 compute, so the runs differ by summation order only, which 40 AdamW steps grow to
    # measured 2.1e-5 relative (the largest over the 40 losses). Bound: 1e-4.
    cfg = config.load(TINY, [*QUIET, "train.steps=40", "model.loss_chunk_size=100"])
    b = program.build(cfg, jax.devices()[:1])
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    batches = [program.put_batch(data.next_batch(), b.batch_sharding) for _ in range(40)]
    data.close()
    assert any(not np.asarray(target_mask(x)).all() for x in batches)  # some targets masked
    off = config.load(TINY, [*QUIET, "train.steps=40", "model.loss_chunk_size=0"])
    graphdef_off = nnx.split(nnx.eval_shape(lambda: program.create_model(off)), nnx.Param, ...)[0]
    curves = {}
    for name, built in (("fused", b), ("logits", dataclasses.replace(b, graphdef=graphdef_off))):
        step = program.jit_train_step(built)
        state = jax.tree.map(jnp.copy, b.state)  # the step donates its input state
        curves[name] = []
        for batch in batches:
            state, metrics = step(state, batch)
            curves[name].append(float(metrics["loss"]))
    fused, plain = np.array(curves["fused"]), np.array(curves["logits"])
    assert np.all(np.abs(fused - plain) <= 1e-4 * np.abs(plain)), np.abs(fused / plain - 1).max()
    assert plain[-1] < plain[0] - 0.5  # it trained


def test_sharded_fused_loss_matches_the_one_device_logits_loss():
    r = run_worker("tests.train.loss_sharded_worker", timeout_s=1500)
    # fsdp_split-fused-v500: the head gathered per chunk in a shard_map (split_dense_gathers),
    # 4 chunks of 128 rows for V = 500, against the one-device logits loss at V = 500.
    # fsdp_tp-tokens: token chunks with the head split over vocab (tensor) and fsdp.
    assert set(r) == {"single-logits", "fsdp-fused", "fsdp_tp-logits", "fsdp_tp-fused"} | {
        "fsdp_tp-tokens",
        "single-logits-v500",
        "fsdp_split-fused-v500",
    }, sorted(r)
    for name, res in r.items():
        # f32 compute: sharding and chunking only reorder reductions (measured <= 2.3e-7 loss,
        # 1.1e-6 of each gradient's largest entry; tests/sharding/test_equivalence.py's bounds).
        assert res["loss_rel"] <= 1e-6, (name, res)
        assert res["grad_rel"] <= 1e-5, (name, res)
    # Under fsdp_tp the head's vocab rows are split over "tensor"; chunk j = rows j, j + N, ...
    # keeps each device's rows its own share of every chunk. Contiguous chunks compile to two
    # more all-to-alls over "tensor" (the head reshuffled before the forward and the backward
    # loop: 3 vs the logits path's 1, the MoE layer's).
    assert r["fsdp_tp-fused"]["all_to_alls"] == r["fsdp_tp-logits"]["all_to_alls"], r
    # The split run reduce-scatters the head's chunk gradient, [D = 64, C = 128], along D: over
    # fsdp_outer (2) to [32, 128], then fsdp_inner (4) to [8, 128] (no other weight has these).
    shapes = r["fsdp_split-fused-v500"]["reduce_scatter_shapes"]
    assert {"f32[32,128]", "f32[8,128]"} <= set(shapes), shapes
