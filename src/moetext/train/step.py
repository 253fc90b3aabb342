"""The train and eval steps (jitted by moetext.train.loop): loss + grads + update, metrics out.

Legend: B batch, S sequence, D emb_dim, V vocab. A batch (moetext.data.batch) is a dict of int32
tokens, segment_ids and positions, each [B, S + 1]: inputs are [:, :-1], targets tokens[:, 1:].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Sharding

from moetext.data.batch import KEYS, target_mask
from moetext.models import HiddenStatesLM
from moetext.train.loss import fused_masked_nll, masked_nll
from moetext.train.state import TrainState

Batch = dict[str, jax.Array]
Params = nnx.State[Any, Any]  # the nnx.Param state of the model (TrainState.params)
Metrics = dict[str, jax.Array]  # scalars, and per-layer arrays such as expert_load
# loss_fn's auxiliary output: (ce, the model's aux dict, nll_sum, count).
LossAux = tuple[jax.Array, dict[str, jax.Array], jax.Array, jax.Array]
LossFn = Callable[[Params, Batch], tuple[jax.Array, LossAux]]


def make_loss_fn(graphdef: nnx.GraphDef[Any], rest: nnx.State[Any, Any]) -> LossFn:
    """loss_fn(params, batch) -> (ce + moe_loss, (ce, aux, nll_sum, count)).

    ce is the mean NLL over the counted targets: not padding, and in the same segment as their
    input token (a document's first token is not predicted from the previous document). A model
    with hidden states (models.HiddenStatesLM) and loss_chunk_size > 0 gets the fused,
    vocab-chunked LM head + cross-entropy (train/loss.py); any other the full logits.
    """

    def loss_fn(params: Params, batch: Batch) -> tuple[jax.Array, LossAux]:
        model = nnx.merge(graphdef, params, rest)
        tokens_BS1, seg_BS1 = batch["tokens"], batch["segment_ids"]
        inputs = {
            "positions_BS": batch["positions"][:, :-1],
            "segment_ids_BS": seg_BS1[:, :-1],
        }
        targets_BS, mask_BS = tokens_BS1[:, 1:], target_mask(batch)
        if isinstance(model, HiddenStatesLM) and model.loss_chunk_size > 0:
            h_BSD, aux = model.hidden_states(tokens_BS1[:, :-1], **inputs)
            nll_sum, count = fused_masked_nll(
                h_BSD, model.head_VD(), targets_BS, mask_BS, chunk_size=model.loss_chunk_size
            )
        else:
            logits_BSV, aux = model(tokens_BS1[:, :-1], **inputs)
            nll_sum, count = masked_nll(logits_BSV, targets_BS, mask_BS)
        ce = nll_sum / jnp.maximum(count, 1.0)
        return ce + aux["moe_loss"], (ce, aux, nll_sum, count)

    return loss_fn


def make_train_step(
    graphdef: nnx.GraphDef[Any],
    rest: nnx.State[Any, Any],
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    skip_nonfinite: bool = False,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """train_step(state, batch) -> (state after one update, metrics): loss, ce_loss, grad_norm,
    lr (of the step taken) and the model's aux outputs (moe_loss, expert_load, ...).

    skip_nonfinite: a step whose loss or grad norm is NaN/Inf keeps the params and optimizer
    state it started from (the step counter still advances) and reports `skipped` = 1 (0 for a
    finite step; the key exists only with skip_nonfinite)."""
    loss_fn = make_loss_fn(graphdef, rest)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        (loss, (ce, aux, _, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, batch
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.tree.norm(grads)
        metrics: Metrics = {
            "loss": loss,
            "ce_loss": ce,
            "grad_norm": grad_norm,
            "lr": lr_schedule(state.step),
            **{k: v for k, v in aux.items()},
        }
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            # A select per leaf, not lax.cond: both branches' values exist already.
            keep = lambda new, old: jnp.where(finite, new, old)
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
            metrics["skipped"] = 1 - finite.astype(jnp.int32)
        new_state = dataclasses.replace(
            state, step=state.step + 1, params=params, opt_state=opt_state
        )
        return new_state, metrics

    return train_step


def make_eval_step(
    graphdef: nnx.GraphDef[Any], rest: nnx.State[Any, Any]
) -> Callable[[Params, Batch], Metrics]:
    """eval_step(params, batch): eval_loss (ce + moe_loss) and eval_ce_loss of the batch, and
    eval_nll_sum / eval_tokens for a token-weighted CE (perplexity) across batches."""
    loss_fn = make_loss_fn(graphdef, rest)

    def eval_step(params: Params, batch: Batch) -> Metrics:
        loss, (ce, _, nll_sum, count) = loss_fn(params, batch)
        return {
            "eval_loss": loss,
            "eval_ce_loss": ce,
            "eval_nll_sum": nll_sum,
            "eval_tokens": count,
        }

    return eval_step


def abstract_batch(
    batch_size: int, seq_len: int, sharding: Sharding
) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch as ShapeDtypeStructs (int32 [B, S + 1] each) for ahead-of-time lowering."""
    shape = (batch_size, seq_len + 1)
    # jax: ShapeDtypeStruct.__init__ is unannotated.
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in KEYS}  # type: ignore[no-untyped-call]
