"""Batched autoregressive decoding with a KV cache, jitted once per shape bucket.

Prompts are left-padded to a multiple of `bucket` tokens (P), so rows of different lengths share
cache slots: row b's tokens sit at slots P - len_b .. P - 1 and every new token of every row at
slot P + i. The prefill runs the P prompt slots in one call; then one `lax.while_loop` decodes a
token per step until every row has produced EOS or max_new_tokens. One compilation per
(batch, P, max_new_tokens, sampling) combination: prompts whose padded length falls in the same
bucket reuse it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moetext.errors import ConfigError
from moetext.generate.sampling import Sampling, sample
from moetext.sharding import logical

BUCKET = 32


@dataclasses.dataclass(frozen=True)
class Generated:
    tokens: list[list[int]]
    """Per prompt, the new tokens before EOS (EOS itself not included)."""
    stopped_at_eos: list[bool]
    logits: np.ndarray | None = None
    """float32 [B, max_new_tokens, V]: the logits each new token was chosen from (rows after
    their EOS hold zeros); only with return_logits."""


def generate_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int | Sequence[int],
    pad_id: int = 0,
    sampling: Sampling | None = None,
    seed: int = 0,
    max_len: int | None = None,
    bucket: int = BUCKET,
    return_logits: bool = False,
    batch_multiple: int = 1,
) -> Generated:
    """Continues each prompt (token ids) with `model` (a family model with `init_cache` and
    `cached`, e.g. the qwen3_moe Decoder built with scan_layers off). Sampling() is greedy.

    Called under a plan's `rules()` (as `python -m moetext.generate` does), the step is traced
    with the preset's activation constraints and sharded MoE dispatch; the batch is then padded
    with copies of the first prompt to a multiple of `batch_multiple` (the batch's shard count),
    and those rows are dropped from the result. eos_id may be several ids (a chat's end-of-turn
    tokens and EOS): a row stops at the first of any."""
    sampling = sampling or Sampling()
    stop = (eos_id,) if isinstance(eos_id, int) else tuple(sorted({int(i) for i in eos_id}))
    if not prompts:
        raise ConfigError("no prompts to continue")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"prompt {i} is empty after tokenization")
        if max_len is not None and len(p) + max_new_tokens > max_len:
            raise ConfigError(
                f"prompt {i} has {len(p)} tokens; with --max_new_tokens {max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} cache slots, more than --max_len {max_len}"
            )
    real = len(prompts)
    prompts = list(prompts) + [prompts[0]] * (-real % batch_multiple)
    longest = max(len(p) for p in prompts)
    padded = -(-longest // bucket) * bucket
    prompts_BP = np.full((len(prompts), padded), pad_id, np.int32)
    first_valid_B = np.zeros(len(prompts), np.int32)
    for b, p in enumerate(prompts):
        prompts_BP[b, padded - len(p) :] = p
        first_valid_B[b] = padded - len(p)
    graphdef, state = nnx.split(model)
    active = logical.current()
    rules_key = None if active is None else (id(active[0]), active[1])
    run = _compiled(graphdef, max_new_tokens, sampling, stop, pad_id, return_logits, rules_key)
    out_BN, done_B, logits = run(state, prompts_BP, first_valid_B, jax.random.key(seed))
    out_BN, done_B = np.asarray(out_BN)[:real], np.asarray(done_B)[:real]
    tokens, stopped = [], []
    for row in out_BN:
        hits = np.flatnonzero(np.isin(row, stop))
        tokens.append(row[: hits[0]].tolist() if hits.size else row.tolist())
        stopped.append(bool(hits.size))
    return Generated(tokens, stopped, np.asarray(logits)[:real] if return_logits else None)


@functools.cache
def _compiled(
    graphdef: Any,
    max_new: int,
    sampling: Sampling,
    stop: tuple[int, ...],
    pad_id: int,
    return_logits: bool,
    rules_key: Any,
) -> Any:
    # rules_key: jit's cache does not key on the active logical rules, so this cache does.
    del rules_key

    @jax.jit
    def run(
        state: Any, prompts_BP: jax.Array, first_valid_B: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        model = nnx.merge(graphdef, state)
        b, p = prompts_BP.shape
        caches = model.init_cache(b, p + max_new)
        positions_BP = jnp.maximum(jnp.arange(p)[None, :] - first_valid_B[:, None], 0)
        logits_BPV, caches = model.cached(prompts_BP, positions_BP, caches, 0, first_valid_B)
        keys = jax.random.split(key, max_new)
        last_BV = logits_BPV[:, -1]
        tok_B = sample(last_BV, keys[0], sampling)
        out_BN = jnp.full((b, max_new), pad_id, jnp.int32).at[:, 0].set(tok_B)
        v = last_BV.shape[-1]
        buf_BNV = jnp.zeros((b, max_new if return_logits else 1, v), jnp.float32)
        if return_logits:
            buf_BNV = buf_BNV.at[:, 0].set(last_BV)
        stops = jnp.asarray(stop, jnp.int32)
        done_B = jnp.isin(tok_B, stops)

        def cond(c: tuple[Any, ...]) -> jax.Array:
            i, _, _, _, done, _ = c
            going: jax.Array = (i < max_new) & ~jnp.all(done)
            return going

        def body(c: tuple[Any, ...]) -> tuple[Any, ...]:
            i, tok, caches, out, done, buf = c
            slot = p + i - 1  # where the previous token goes
            pos_B1 = (slot - first_valid_B)[:, None]
            logits_B1V, caches = model.cached(tok[:, None], pos_B1, caches, slot, first_valid_B)
            logits_BV = logits_B1V[:, 0]
            nxt = jnp.where(done, pad_id, sample(logits_BV, keys[i], sampling))
            out = out.at[:, i].set(nxt)
            if return_logits:
                buf = buf.at[:, i].set(jnp.where(done[:, None], 0.0, logits_BV))
            return i + 1, nxt, caches, out, done | jnp.isin(nxt, stops), buf

        init = (jnp.int32(1), tok_B, caches, out_BN, done_B, buf_BNV)
        _, _, _, out_BN, done_B, buf_BNV = jax.lax.while_loop(cond, body, init)
        return out_BN, done_B, buf_BNV

    return run
