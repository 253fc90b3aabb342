"""The training objective: masked next-token NLL, from full logits or fused with the LM head.

Legend: B batch, S sequence, T tokens (B * S), D emb_dim, V vocab, N vocab chunks, C vocab rows
per chunk (N * C >= V).

    nll_sum, count = masked_nll(logits_BSV, targets_BS, mask_BS)          # the logits path
    nll_sum, count = logits_masked_nll(h_BSD, head_VD, targets_BS, mask_BS)  # the same, from h
    nll_sum, count = fused_masked_nll(h_BSD, head_VD, targets_BS, mask_BS, chunk_size=2048)
    nll_sum, count = fused_masked_nll(..., chunk_size=2048, chunks="tokens")  # token chunks

`fused_masked_nll` takes the final hidden states (after the final norm) and the LM head's
weight instead of the logits, and never holds [T, V]: `lm_head_nll` loops (lax.scan) over N
vocab chunks of C <= chunk_size rows (on the split_dense_gathers path a multiple of 128,
so at least 128: `chunking`), keeping per token a running max, the sum of exponentials
rescaled to it, and the target's logit (float32 statistics). Its custom_vjp keeps only the
inputs and the logsumexp [T]; the backward loops over the chunks again, recomputes each chunk's
logits and forms dlogits = (softmax - onehot) * dnll, accumulates dh [T, D] in float32 and
writes the chunk's rows of dW. So the largest temporaries are [T, C], not the [T, V] float32
logits and log-softmax (plus their gradient) of the logits path. The price is one more
[T, D] x [D, V] matmul (the backward recomputes the logits): 4 head matmuls instead of 3.

`chunks="tokens"` (`token_chunked_nll`, model.loss_chunks' CPU default) loops over chunks of
tokens against the whole vocabulary instead and forms the gradient in the forward: 3 head
matmuls, a [V, D] float32 gradient kept until the backward (its docstring says when to use it).
On a CPU without bfloat16 dot instructions every head matmul widens its operands to float32
(kernels/host_dots.py), the same products and float32 sums, faster there; where the operands
stay bfloat16, dW is accumulated as [D, V] from h's transpose (`_tokens_nll_fwd` says why).

Numerics: every matmul takes h and the head in the compute dtype (h's dtype; the head is cast
to it, as the model's own head einsum does) and accumulates and returns float32
(preferred_element_type); dlogits are cast to the compute dtype for the two backward matmuls,
as autodiff of the logits path casts them, except where those matmuls widen their operands to
float32 (a CPU without bfloat16 dots) and take them unrounded. The logits path instead rounds
the logits to the compute dtype before its float32 log-softmax (models/qwen3_moe/model.py), so
with bfloat16 compute the two differ by that rounding (the fused path is the more exact one);
with float32 compute they agree to float32 rounding. Compute-dtype outputs (the logits path's
numerics) made the bench-tiny-moe step 2.5% slower on CPU, where XLA lowers both to the same
bf16 YNNPACK dot and a bf16 output only adds a conversion (docs/performance.md).

Chunk j holds vocab rows j, j + N, j + 2N, ... (w.reshape(C, N, D)[:, j]), not a contiguous
block: when a sharding preset splits "vocab" over a mesh axis (fsdp_tp), every device keeps its
contiguous share of the head as its share of each chunk, so the loop never gathers the head
across that axis; the chunk is constrained to ("vocab", "embed") and its logits to ("batch",
"vocab"), the layout of the logits path's [B, S, V].
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from moetext.kernels.gmm.gather import (
    Gather,
    all_gather_dims,
    gathered_shape,
    psum_scatter_dims,
)
from moetext.kernels.host_dots import bf16_dots_on_this_cpu, upcast_bf16_dots
from moetext.kernels.pallas import target
from moetext.sharding import fsdp
from moetext.sharding.logical import constrain

F32 = jnp.float32
HEAD_NAMES = ("vocab", "embed")  # the LM head's (and a tied embedding's) logical axes
# The token path's float32 logits per chunk: tokens per chunk = this / (4 V), 512 for V = 32000.
TOKEN_CHUNK_LOGITS_BYTES = 64 * 2**20


def resolve_chunks(chunks: str) -> Literal["vocab", "tokens"]:
    """model.loss_chunks: "auto" is "tokens" when the step runs on this process's CPU (not on,
    nor compiled ahead of time for, an accelerator), else "vocab"."""
    if chunks not in ("auto", "vocab", "tokens"):
        raise ValueError(f"loss chunks must be one of auto, vocab, tokens; got {chunks!r}")
    if chunks == "auto":
        cpu = not target.tpu_code() and jax.default_backend() == "cpu"
        return "tokens" if cpu else "vocab"
    return "tokens" if chunks == "tokens" else "vocab"


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], upcast: bool) -> jax.Array:
    """a . b over (a's dim, b's dim), float32 out; upcast: the operands widened to float32
    first (kernels/host_dots.py: a CPU without bfloat16 dots)."""
    if upcast:
        a, b = a.astype(F32), b.astype(F32)
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=F32)


def _dlogits_operand(dlogits: jax.Array, dtype: jnp.dtype, upcast: bool) -> jax.Array:
    """The float32 dlogits as the backward head matmuls take them: rounded to the compute dtype,
    as autodiff of the logits path rounds them, unless the matmuls widen their operands to
    float32 anyway (upcast): a bfloat16 round trip there only loses bits and costs a pass over
    [T, C] (docs/performance.md)."""
    return dlogits if upcast else dlogits.astype(dtype)


def masked_nll(
    logits_BSV: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(sum of the counted targets' NLL, their number), both f32, with an f32 log-softmax."""
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(F32), axis=-1)
    nll_BS = -jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]
    mask_BS = mask_BS.astype(F32)
    return jnp.sum(nll_BS * mask_BS), jnp.sum(mask_BS)


def logits_masked_nll(
    h_BSD: jax.Array, head_VD: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """masked_nll of the logits h_BSD @ head_VD.T formed whole, as a model's `__call__` forms
    them (the head cast to h's compute dtype, logits rounded to it): the logits path's NLL for
    more heads of one model (multi-token prediction, models.LossTargets)."""
    logits_BSV = jnp.einsum("bsd,vd->bsv", h_BSD, head_VD.astype(h_BSD.dtype))
    logits_BSV = constrain(logits_BSV.astype(F32), ("batch", "length", "vocab"))
    return masked_nll(logits_BSV, targets_BS, mask_BS)


def fused_masked_nll(
    h_BSD: jax.Array,
    head_VD: jax.Array,
    targets_BS: jax.Array,
    mask_BS: jax.Array,
    *,
    chunk_size: int,
    chunks: str = "vocab",
) -> tuple[jax.Array, jax.Array]:
    """masked_nll of the logits h_BSD @ head_VD.T, computed chunk by chunk: over vocab chunks
    (`lm_head_nll`) or over token chunks (`token_chunked_nll`), by `chunks` (`resolve_chunks`).

    h_BSD: the final norm's output in the compute dtype; head_VD: the LM head (any float dtype,
    cast to h's like the model's head einsum); chunk_size: the most vocab rows per chunk."""
    b, s, d = h_BSD.shape
    if head_VD.ndim != 2 or head_VD.shape[1] != d:
        raise ValueError(f"head {head_VD.shape} must be [V, {d}] for hidden states {h_BSD.shape}")
    if targets_BS.shape != (b, s) or mask_BS.shape != (b, s):
        raise ValueError(
            f"targets {targets_BS.shape} and mask {mask_BS.shape} must be [B, S] = {(b, s)}"
        )
    # B * S flattened batch-major: the token axis keeps the batch's sharding.
    h_TD = constrain(h_BSD.reshape(b * s, d), ("batch", "embed"))
    w_VD, targets_T = head_VD.astype(h_BSD.dtype), targets_BS.reshape(b * s)
    mask_T = mask_BS.reshape(b * s).astype(F32)
    plan = fsdp.plan_for(head_VD, HEAD_NAMES)
    split = plan is not None and all(dim == 1 for dim, _ in plan.gather)
    if not split and resolve_chunks(chunks) == "tokens":
        return token_chunked_nll(h_TD, w_VD, targets_T, mask_T), jnp.sum(mask_T)
    if plan is None or not split:
        nll_T = lm_head_nll(h_TD, w_VD, targets_T, chunk_size)
    else:  # sharding.split_dense_gathers on a split mesh: per token shard (sharding/fsdp.py)
        # The head is cast first, as on the path above, so its chunks' gradients are
        # reduce-scattered in the compute dtype. (Tried in f32 with 1187-row chunks: twice the
        # bytes and 0.57 GiB more per chip on the 30B step on v5p:4x4x2; docs/performance.md.)
        gather = plan.gather
        nll_T = jax.shard_map(
            lambda h, w, t: lm_head_nll(h, w, t, chunk_size, gather),
            mesh=plan.mesh,
            in_specs=(plan.tokens, plan.w_spec, plan.tokens),
            out_specs=plan.tokens,
            check_vma=False,  # the specs state the replication exactly (as in layers/project.py)
        )(h_TD, w_VD, targets_T)
    return jnp.sum(nll_T * mask_T), jnp.sum(mask_T)


def chunking(vocab: int, chunk_size: int, multiple: int = 1) -> tuple[int, int]:
    """(N, C): N chunks of C <= chunk_size rows covering `vocab`. The fewest chunks that split
    it evenly when that is at most twice the minimum ceil(vocab / chunk_size) (32000 by 2048:
    16 x 2000; 151936 by 2048: 128 x 1187), else the minimum, the last row of some chunks padded.

    multiple > 1: C a multiple of it (chunk_size rounded down to one, at least `multiple`),
    the N within twice the minimum that pads the fewest rows, ties to fewer chunks (151936 by
    2048 in multiples of 128: 99 x 1536, 128 rows padded)."""
    if vocab < 1 or chunk_size < 1 or multiple < 1:
        raise ValueError(
            f"vocab ({vocab}), chunk_size ({chunk_size}) and multiple ({multiple}) must be >= 1"
        )
    if multiple > 1:
        most = max(chunk_size // multiple, 1)  # C = k * multiple, k <= most
        least = math.ceil(vocab / (most * multiple))
        options = [(math.ceil(vocab / (k * multiple)), k * multiple) for k in range(most, 0, -1)]
        return min(
            ((n, c) for n, c in options if n <= 2 * least), key=lambda nc: (nc[0] * nc[1], nc[0])
        )
    least = math.ceil(vocab / chunk_size)
    for n in range(least, min(2 * least, vocab) + 1):
        if vocab % n == 0:
            return n, vocab // n
    return least, math.ceil(vocab / least)


def lm_head_nll(
    h_TD: jax.Array,
    w_VD: jax.Array,
    targets_T: jax.Array,
    chunk_size: int,
    gather: Gather = (),
) -> jax.Array:
    """nll_T float32 = logsumexp(h_TD @ w_VD.T) - the target's logit, without the [T, V]
    logits: vocab chunks of at most chunk_size rows (module docstring). h and w share the
    compute dtype; targets_T are int in [0, V) (one outside scores logsumexp alone).

    gather: inside a shard_map, the (dim, mesh axes) pairs w_VD is split along (D only): each
    chunk is all-gathered along them and its gradient reduce-scattered back, so w_VD and its
    gradient stay this shard's slice."""
    if any(dim != 1 for dim, _ in gather):
        raise ValueError(f"lm_head_nll: only D (dim 1) of the head can be gathered, got {gather}")
    if h_TD.ndim != 2 or w_VD.ndim != 2:
        raise ValueError(f"lm_head_nll: h {h_TD.shape} and w {w_VD.shape} must be [T, D], [V, D]")
    w_dim = gathered_shape(w_VD.shape, gather)[1]
    if h_TD.shape[1] != w_dim:
        raise ValueError(
            f"lm_head_nll: h {h_TD.shape} and w {w_VD.shape} (D = {w_dim} gathered) must be "
            f"[T, D], [V, D]"
        )
    if h_TD.dtype != w_VD.dtype:
        raise ValueError(f"lm_head_nll: h ({h_TD.dtype}) and w ({w_VD.dtype}) must share a dtype")
    if targets_T.shape != h_TD.shape[:1] or not jnp.issubdtype(targets_T.dtype, jnp.integer):
        raise ValueError(
            f"lm_head_nll: targets must be integer [{h_TD.shape[0]}], got "
            f"{targets_T.dtype}{targets_T.shape}"
        )
    upcast = upcast_bf16_dots(h_TD.dtype)
    nll_T: jax.Array = _nll(chunk_size, gather, upcast, h_TD, w_VD, targets_T)
    return nll_T


def _chunked(w_VD: jax.Array, n: int, c: int) -> jax.Array:
    """w_CND: w_CND[a, j] = w_VD[a * N + j], zero rows past V."""
    v, d = w_VD.shape
    if n * c > v:
        w_VD = jnp.pad(w_VD, ((0, n * c - v), (0, 0)))
    return w_VD.reshape(c, n, d)


def _chunk_logits(
    h_TD: jax.Array, w_CND: jax.Array, j: jax.Array, vocab: int, gather: Gather, upcast: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w_CD, logits_TC float32, ids_C) of chunk j (w_CD gathered along `gather`); padded
    rows' logits are -inf."""
    c, n, _ = w_CND.shape
    w_CD = lax.dynamic_index_in_dim(w_CND, j, axis=1, keepdims=False)
    if gather:  # inside a shard_map: explicit per-axis gathers, no GSPMD constraints
        w_CD = all_gather_dims(w_CD, gather)
    else:
        w_CD = constrain(w_CD, ("vocab", "embed"))
    logits_TC = _dot(h_TD, w_CD, (1, 1), upcast)
    if not gather:
        logits_TC = constrain(logits_TC, ("batch", "vocab"))
    ids_C = jnp.arange(c, dtype=jnp.int32) * n + j
    if n * c > vocab:
        logits_TC = jnp.where(ids_C < vocab, logits_TC, -jnp.inf)
    return w_CD, logits_TC, ids_C


def _logsumexp_and_target(
    h_TD: jax.Array,
    w_VD: jax.Array,
    targets_T: jax.Array,
    chunk_size: int,
    gather: Gather,
    upcast: bool,
) -> tuple[jax.Array, jax.Array]:
    """(lse_T, target logit_T), float32, one vocab chunk at a time."""
    (t, _), vocab = h_TD.shape, w_VD.shape[0]
    n, c = chunking(vocab, chunk_size, _multiple(gather))
    w_CND = _chunked(w_VD, n, c)

    def body(
        carry: tuple[jax.Array, jax.Array, jax.Array], j: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        max_T, sum_T, target_T = carry
        _, logits_TC, ids_C = _chunk_logits(h_TD, w_CND, j, vocab, gather, upcast)
        new_max_T = jnp.maximum(max_T, jnp.max(logits_TC, axis=1))
        # Every chunk has a valid row, so new_max_T is finite and exp(-inf - new_max) = 0.
        sum_T = sum_T * jnp.exp(max_T - new_max_T) + jnp.sum(
            jnp.exp(logits_TC - new_max_T[:, None]), axis=1
        )
        hit_TC = ids_C[None, :] == targets_T[:, None]
        target_T = target_T + jnp.sum(jnp.where(hit_TC, logits_TC, 0.0), axis=1)
        return (new_max_T, sum_T, target_T), None

    init = (jnp.full((t,), -jnp.inf, F32), jnp.zeros((t,), F32), jnp.zeros((t,), F32))
    (max_T, sum_T, target_T), _ = lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return max_T + jnp.log(sum_T), target_T


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _nll(
    chunk_size: int,
    gather: Gather,
    upcast: bool,
    h_TD: jax.Array,
    w_VD: jax.Array,
    targets_T: jax.Array,
) -> jax.Array:
    return _nll_fwd(chunk_size, gather, upcast, h_TD, w_VD, targets_T)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _nll_fwd(
    chunk_size: int,
    gather: Gather,
    upcast: bool,
    h_TD: jax.Array,
    w_VD: jax.Array,
    targets_T: jax.Array,
) -> tuple[jax.Array, Residuals]:
    lse_T, target_T = _logsumexp_and_target(h_TD, w_VD, targets_T, chunk_size, gather, upcast)
    return lse_T - target_T, (h_TD, w_VD, targets_T, lse_T)


def _nll_bwd(
    chunk_size: int, gather: Gather, upcast: bool, res: Residuals, dnll_T: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    h_TD, w_VD, targets_T, lse_T = res
    (t, d), (vocab, d_w) = h_TD.shape, w_VD.shape
    n, c = chunking(vocab, chunk_size, _multiple(gather))
    w_CND = _chunked(w_VD, n, c)
    dnll_T = dnll_T.astype(F32)

    def body(dh_TD: jax.Array, j: jax.Array) -> tuple[jax.Array, jax.Array]:
        w_CD, logits_TC, ids_C = _chunk_logits(h_TD, w_CND, j, vocab, gather, upcast)
        hit_TC = ids_C[None, :] == targets_T[:, None]
        dlogits_TC = (jnp.exp(logits_TC - lse_T[:, None]) - hit_TC) * dnll_T[:, None]
        dlogits_TC = _dlogits_operand(dlogits_TC, h_TD.dtype, upcast)
        if not gather:
            dlogits_TC = constrain(dlogits_TC, ("batch", "vocab"))
        dh_TD = dh_TD + _dot(dlogits_TC, w_CD, (1, 0), upcast)
        if gather:
            # This shard's tokens' part -> the sum over shards of this shard's slice. Computed
            # as [D, C] and scattered along D as the major dim: scattered along the minor dim
            # of a row-major [C, D], XLA:TPU runs each stage as an all-reduce of the whole
            # chunk and a slice (docs/performance.md, "Dense weights gathered one split axis
            # at a time").
            dw_DC = _dot(h_TD, dlogits_TC, (0, 0), upcast)
            return dh_TD, psum_scatter_dims(dw_DC.astype(w_VD.dtype), _transposed(gather))
        dw_CD = _dot(dlogits_TC, h_TD, (0, 0), upcast)
        return dh_TD, constrain(dw_CD.astype(w_VD.dtype), ("vocab", "embed"))

    dh_TD, dw_N = lax.scan(body, jnp.zeros((t, d), F32), jnp.arange(n, dtype=jnp.int32))
    # Back from chunk-major [N, C, D] (gathered: [N, D, C]) to row order a * N + j, then drop
    # the padding.
    dw_CND = jnp.transpose(dw_N, (2, 0, 1) if gather else (1, 0, 2))
    dw_VD = dw_CND.reshape(n * c, d_w)[:vocab]
    return dh_TD.astype(h_TD.dtype), dw_VD, None


def _multiple(gather: Gather) -> int:
    """Chunk rows a multiple of 128 (TPU lanes) when each chunk's gradient is reduce-scattered
    in the shard_map (gather): XLA:TPU runs the reduce-scatter of a [D, 1187] chunk gradient
    as an all-reduce and a slice, of a [D, 1536] one as a reduce-scatter (docs/performance.md,
    "Dense weights gathered one split axis at a time"). GSPMD's collectives (no gather) do not
    change with it, and CPU chunks keep the exact split."""
    return 128 if gather else 1


def _transposed(gather: Gather) -> Gather:
    """`gather` of a [C, D] chunk (D only, lm_head_nll checks) as the gather of its [D, C]."""
    return tuple((1 - dim, axes) for dim, axes in gather)


_nll.defvjp(_nll_fwd, _nll_bwd)


def token_chunked_nll(
    h_TD: jax.Array, w_VD: jax.Array, targets_T: jax.Array, weights_T: jax.Array
) -> jax.Array:
    """sum_t weights_T[t] * nll_T[t] (float32 scalar) of the logits h_TD @ w_VD.T, over chunks
    of tokens that each see the whole vocabulary (the `chunks="tokens"` path).

    Every chunk holds its [T/N, V] float32 logits (TOKEN_CHUNK_LOGITS_BYTES at most: 512 tokens
    for V = 32000), so its softmax is final at once: under differentiation the forward also
    forms the chunk's dlogits = (softmax - onehot) * weights and from them dh and the chunk's
    share of dW (a float32 [V, D] accumulator); the backward only scales both by the scalar
    cotangent. Three head matmuls instead of the vocab path's four, for a [V, D] float32
    gradient kept between forward and backward: the faster choice on a CPU, where the head
    matmuls are most of the step (docs/performance.md). Not under a sharded head: each chunk's
    dW sums over tokens, so under FSDP every chunk would reduce a whole [V, D] partial
    gradient across devices, where a vocab chunk reduces its own rows once. Evaluation (no
    differentiation) runs one matmul per chunk.

    Chunk j holds tokens j, j + N, j + 2N, ... (padded with weight-0 tokens to N * C): a
    token-sharded h keeps each device's share in every chunk. weights_T: float32 [T] (the
    target mask); h_TD and w_VD share the compute dtype; targets_T int in [0, V)."""
    (t, d), v = h_TD.shape, w_VD.shape[0]
    if w_VD.ndim != 2 or w_VD.shape[1] != d or h_TD.dtype != w_VD.dtype:
        raise ValueError(
            f"token_chunked_nll: h {h_TD.dtype}{h_TD.shape} and w {w_VD.dtype}{w_VD.shape} "
            f"must be [T, D], [V, D] of one dtype"
        )
    if targets_T.shape != (t,) or weights_T.shape != (t,):
        raise ValueError(
            f"token_chunked_nll: targets {targets_T.shape} and weights {weights_T.shape} must "
            f"be [{t}]"
        )
    most = max(TOKEN_CHUNK_LOGITS_BYTES // (4 * v), 1)
    n = math.ceil(t / most)
    c = math.ceil(t / n)
    xs: tuple[jax.Array, ...] = (h_TD, targets_T, weights_T.astype(F32))
    if n * c > t:  # weight-0 padding tokens
        xs = tuple(jnp.pad(x, ((0, n * c - t),) + ((0, 0),) * (x.ndim - 1)) for x in xs)
    # [N * C, ...] -> [N, C, ...], chunk j = rows j, j + N, ...
    h_NCD, targets_NC, weights_NC = (x.reshape(c, n, *x.shape[1:]).swapaxes(0, 1) for x in xs)
    upcast = upcast_bf16_dots(h_TD.dtype)
    total: jax.Array = _tokens_nll(upcast, h_NCD, w_VD, targets_NC, weights_NC)
    return total


def _token_chunk(
    h_CD: jax.Array, w_VD: jax.Array, targets_C: jax.Array, upcast: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(logits_CV float32, lse_C, nll_C) of one token chunk."""
    logits_CV = constrain(_dot(h_CD, w_VD, (1, 1), upcast), ("batch", "vocab"))
    lse_C = jax.nn.logsumexp(logits_CV, axis=1)
    target_C = jnp.take_along_axis(logits_CV, targets_C[:, None], axis=1)[:, 0]
    return logits_CV, lse_C, lse_C - target_C


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tokens_nll(
    upcast: bool,
    h_NCD: jax.Array,
    w_VD: jax.Array,
    targets_NC: jax.Array,
    weights_NC: jax.Array,
) -> jax.Array:
    wide_VD = w_VD.astype(F32) if upcast else w_VD  # widened once, not per chunk

    def body(total: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        h_CD, targets_C, weights_C = xs
        _, _, nll_C = _token_chunk(h_CD, wide_VD, targets_C, upcast)
        return total + jnp.sum(nll_C * weights_C), None

    total, _ = lax.scan(body, jnp.zeros((), F32), (h_NCD, targets_NC, weights_NC))
    return total


def _tokens_nll_fwd(
    upcast: bool,
    h_NCD: jax.Array,
    w_VD: jax.Array,
    targets_NC: jax.Array,
    weights_NC: jax.Array,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    wide_VD = w_VD.astype(F32) if upcast else w_VD
    ids_V = jnp.arange(w_VD.shape[0], dtype=jnp.int32)
    # dW contracts over the chunk's tokens, the major dim of both dlogits [C, V] and h [C, D].
    # XLA:CPU runs that form through Eigen, which has no bfloat16 kernel: bfloat16 operands on
    # a CPU with bfloat16 dots take h's transpose instead, [D, C] @ [C, V] on YNNPACK's
    # bfloat16 dot, into a [D, V] accumulator transposed once at the end (~3x faster per chunk
    # on an AVX512-BF16 EPYC). Widened float32 operands keep Eigen's [V, D], measured faster
    # there, as does code for an accelerator (docs/performance.md).
    dw_transposed = bf16_dots_on_this_cpu(h_NCD.dtype)
    xs: tuple[jax.Array, ...] = (h_NCD, targets_NC, weights_NC)
    if dw_transposed:  # h's transpose [N, D, C] rides along: the loop keeps it materialized
        xs += (jnp.swapaxes(h_NCD, 1, 2),)

    def body(
        carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        total, dw = carry
        h_CD, targets_C, weights_C, *h_DC = xs
        logits_CV, lse_C, nll_C = _token_chunk(h_CD, wide_VD, targets_C, upcast)
        hit_CV = ids_V[None, :] == targets_C[:, None]
        dlogits_CV = _dlogits_operand(
            (jnp.exp(logits_CV - lse_C[:, None]) - hit_CV) * weights_C[:, None], h_CD.dtype, upcast
        )
        dh_CD = _dot(dlogits_CV, wide_VD, (1, 0), upcast)
        if h_DC:  # dW as [D, V]
            dw = constrain(dw + _dot(h_DC[0], dlogits_CV, (1, 0), upcast), HEAD_NAMES[::-1])
        else:
            dw = constrain(dw + _dot(dlogits_CV, h_CD, (0, 0), upcast), HEAD_NAMES)
        return (total + jnp.sum(nll_C * weights_C), dw), dh_CD

    dw_shape = w_VD.shape[::-1] if dw_transposed else w_VD.shape
    init = (jnp.zeros((), F32), jnp.zeros(dw_shape, F32))
    (total, dw), dh_NCD = lax.scan(body, init, xs)
    dw_VD = dw.T if dw_transposed else dw
    # float32 until the cotangent scales them (the compute dtype's zero-size marker rides along)
    return total, (dh_NCD, dw_VD, jnp.zeros((0,), h_NCD.dtype))


def _tokens_nll_bwd(
    upcast: bool, res: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array
) -> tuple[jax.Array, jax.Array, None, None]:
    dh_NCD, dw_VD, like = res
    # Scaled in float32 and rounded once to the compute dtype, as the vocab path's dh and dW.
    return (g * dh_NCD).astype(like.dtype), (g * dw_VD).astype(like.dtype), None, None


_tokens_nll.defvjp(_tokens_nll_fwd, _tokens_nll_bwd)
