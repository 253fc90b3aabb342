"""The jitted train and eval steps: loss + grads + update, metrics out.

Legend: B batch, S sequence, V vocab. A batch is int32 tokens [B, S + 1].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moetext.train.state import TrainState


def cross_entropy(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy with an f32 log-softmax."""
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    nll_BS = -jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return nll_BS.mean()


def make_loss_fn(graphdef: nnx.GraphDef, rest: nnx.State) -> Callable:
    def loss_fn(params: nnx.State, tokens_BS1: jax.Array):
        model = nnx.merge(graphdef, params, rest)
        logits_BSV, aux = model(tokens_BS1[:, :-1])
        ce = cross_entropy(logits_BSV, tokens_BS1[:, 1:])
        return ce + aux["moe_loss"], (ce, aux)

    return loss_fn


def make_train_step(
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, Any]]]:
    loss_fn = make_loss_fn(graphdef, rest)

    def train_step(state: TrainState, tokens_BS1: jax.Array):
        (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, tokens_BS1
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "ce_loss": ce,
            "grad_norm": optax.tree.norm(grads),
            "lr": lr_schedule(state.step),
            **{k: v for k, v in aux.items()},
        }
        new_state = dataclasses.replace(
            state, step=state.step + 1, params=params, opt_state=opt_state
        )
        return new_state, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, rest: nnx.State) -> Callable:
    loss_fn = make_loss_fn(graphdef, rest)

    def eval_step(params: nnx.State, tokens_BS1: jax.Array):
        loss, (ce, aux) = loss_fn(params, tokens_BS1)
        return {"eval_loss": loss, "eval_ce_loss": ce}

    return eval_step
