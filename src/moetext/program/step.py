"""The train and eval steps (jitted by moetext.program.build): loss + grads + update, metrics out.

Legend: B batch, S sequence, D emb_dim, V vocab, N micro-batches (train.grad_accum_steps),
M = B / N rows per micro-batch, X any trailing dims. A batch (moetext.data.batch) is a dict of
int32 tokens, segment_ids and positions, each [B, S + 1]: inputs are [:, :-1], targets
tokens[:, 1:].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from moetext.data.batch import target_mask
from moetext.models import (
    HiddenStatesLM,
    LossTargets,
    ModelState,
    ModelStateLM,
    TargetsLM,
    added_loss,
)
from moetext.program.loss import fused_masked_nll, logits_masked_nll, masked_nll
from moetext.program.state import TrainState

Batch = dict[str, jax.Array]
Params = nnx.State[Any, Any]  # the nnx.Param state of the model (TrainState.params)
# Its models.ModelState variables (TrainState.model_state): read by the forward, not
# differentiated. None for a caller that has none (a model without ModelState).
ModelStates = nnx.State[Any, Any] | None
Metrics = dict[str, jax.Array]  # scalars, and per-layer arrays such as expert_load
# loss_fn's auxiliary output: (ce, the model's aux dict, nll_sum, count).
LossAux = tuple[jax.Array, dict[str, jax.Array], jax.Array, jax.Array]


class LossFn(Protocol):
    """(params, batch, model_state, the whole step's batch when batch is one of its micro-batches)
    -> (loss, LossAux): make_loss_fn's."""

    def __call__(
        self,
        params: Params,
        batch: Batch,
        model_state: ModelStates = None,
        step: Batch | None = None,
        /,
    ) -> tuple[jax.Array, LossAux]: ...


GradFn = Callable[[Params, Batch, ModelStates], tuple[tuple[jax.Array, LossAux], Params]]
# (params, model_state, a micro-batch's aux) -> the model state the next micro-batch reads.
Accumulate = Callable[[Params, ModelStates, dict[str, jax.Array]], Any]
# What the update needs of the loss besides the gradient: (loss, ce, the model's aux dict).
Losses = tuple[jax.Array, jax.Array, dict[str, jax.Array]]


def make_loss_fn(graphdef: nnx.GraphDef[Any], rest: nnx.State[Any, Any]) -> LossFn:
    """loss_fn(params, batch, model_state=None, step=None) -> (ce + added_loss(aux), (ce, aux,
    nll_sum, count)).

    ce is the mean NLL over the counted targets: not padding, and in the same segment as their
    input token (a document's first token is not predicted from the previous document). A model
    with hidden states (models.HiddenStatesLM) and loss_chunk_size > 0 gets the fused,
    vocab-chunked LM head + cross-entropy (program/loss.py); any other the full logits.
    added_loss(aux) (models/family.py) is the model's weighted moe_loss plus its extra_loss, if
    any: a model reading targets (models.TargetsLM, e.g. multi-token prediction) gets them and
    the same NLL function as the main loss (models.LossTargets) and weighs its own terms; step,
    the whole step's batch when batch is one of its micro-batches, reaches it as the step's
    target mask and segment ids, so it can normalise its terms by the step's counts.
    Differentiated with respect to params only (argument 0): model_state (the model's
    ModelState variables, required when it has any) is read, never a gradient's.
    """

    def loss_fn(
        params: Params, batch: Batch, model_state: ModelStates = None, step: Batch | None = None
    ) -> tuple[jax.Array, LossAux]:
        states = (params, rest) if model_state is None else (params, model_state, rest)
        model = nnx.merge(graphdef, *states)
        tokens_BS1, seg_BS1 = batch["tokens"], batch["segment_ids"]
        inputs: dict[str, Any] = {
            "positions_BS": batch["positions"][:, :-1],
            "segment_ids_BS": seg_BS1[:, :-1],
        }
        targets_BS, mask_BS = tokens_BS1[:, 1:], target_mask(batch)
        chunk, by = 0, "vocab"
        if isinstance(model, HiddenStatesLM):
            chunk, by = model.loss_chunk_size, model.loss_chunks
        if isinstance(model, TargetsLM) and model.reads_targets:
            nll = logits_masked_nll
            if chunk > 0:
                nll = functools.partial(fused_masked_nll, chunk_size=chunk, chunks=by)
            step_views: dict[str, jax.Array] = {}
            if step is not None:
                step_views["step_mask_BS"] = target_mask(step)
                step_views["step_segment_ids_BS"] = step["segment_ids"][:, :-1]
            inputs["targets"] = LossTargets(targets_BS, mask_BS, nll, **step_views)
        if isinstance(model, HiddenStatesLM) and chunk > 0:
            h_BSD, aux = model.hidden_states(tokens_BS1[:, :-1], **inputs)
            nll_sum, count = fused_masked_nll(
                h_BSD, model.head_VD(), targets_BS, mask_BS, chunk_size=chunk, chunks=by
            )
        else:
            logits_BSV, aux = model(tokens_BS1[:, :-1], **inputs)
            nll_sum, count = masked_nll(logits_BSV, targets_BS, mask_BS)
        ce = nll_sum / jnp.maximum(count, 1.0)
        return ce + added_loss(aux), (ce, aux, nll_sum, count)

    return loss_fn


def make_train_step(
    *args: Any, **kwargs: Any
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """train_step(state, batch) -> (state after one update, metrics), one function:
    `update(state, *gradient(state, batch))` of `make_train_step_parts(*args, **kwargs)`."""
    gradient, update = make_train_step_parts(*args, **kwargs)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        return update(state, *gradient(state, batch))

    return train_step


def make_train_step_parts(
    graphdef: nnx.GraphDef[Any],
    rest: nnx.State[Any, Any],
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    skip_nonfinite: bool = False,
    grad_accum_steps: int = 1,
    param_shardings: Any = None,
    batch_sharding: NamedSharding | None = None,
) -> tuple[
    Callable[[TrainState, Batch], tuple[Params, Losses]],
    Callable[[TrainState, Params, Losses], tuple[TrainState, Metrics]],
]:
    """The train step's two halves: train_step_gradient(state, batch) -> (grads, (loss, ce, aux))
    and train_step_update(state, grads, (loss, ce, aux)) -> (state after one update, metrics):
    loss, ce_loss, grad_norm, lr (of the step taken), loss_tokens (the targets the loss is the
    mean over: not padding, and in chat data only the trained ones) and the model's aux outputs
    (moe_loss, expert_load, ...). `program.jit_train_step` jits them as one program
    (`make_train_step`) or, with train.separate_update, as two.

    The update also advances the model state: a model with ModelState variables that follows
    models.ModelStateLM has `update_model_state(aux)` called on it, merged from the new params
    and the state's model_state, and the new ModelState values become the state's; the
    optimizer never sees them. A model without ModelState compiles to the same program as
    before there was any.

    skip_nonfinite: a step whose loss or grad norm is NaN/Inf keeps the params, optimizer state
    and model state it started from (the step counter still advances) and reports `skipped` = 1
    (0 for a finite step; the key exists only with skip_nonfinite).
    grad_accum_steps: N > 1 computes the gradient over N micro-batches of the batch in a scan
    (`accumulated_value_and_grad`), then takes one update; param_shardings (a tree like the
    params) and batch_sharding (the batch's) pin the accumulator and the micro-batches."""
    loss_fn = make_loss_fn(graphdef, rest)
    grad_fn: GradFn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum_steps > 1:
        grad_fn = accumulated_value_and_grad(
            loss_fn,
            grad_accum_steps,
            param_shardings,
            batch_sharding,
            accumulate=make_accumulate(graphdef, rest),
        )

    def train_step_gradient(state: TrainState, batch: Batch) -> tuple[Params, Losses]:
        (loss, (ce, aux, _, count)), grads = grad_fn(state.params, batch, state.model_state)
        # loss_tokens: the global count of trained targets (the loss is their mean).
        return grads, (loss, ce, {**aux, "loss_tokens": count})

    def next_model_state(params: Params, state: TrainState, aux: dict[str, jax.Array]) -> Any:
        if not jax.tree.leaves(state.model_state):
            return state.model_state
        # copy: update_model_state sets new Variables, leaving the state's own (the values a
        # skipped step keeps) as they were.
        model = nnx.merge(graphdef, params, state.model_state, rest, copy=True)
        if not isinstance(model, ModelStateLM):
            return state.model_state
        model.update_model_state(aux)
        return nnx.state(model, ModelState)

    def train_step_update(
        state: TrainState, grads: Params, losses: Losses
    ) -> tuple[TrainState, Metrics]:
        loss, ce, aux = losses
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        model_state = next_model_state(params, state, aux)
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
            model_state = jax.tree.map(keep, model_state, state.model_state)
            metrics["skipped"] = 1 - finite.astype(jnp.int32)
        new_state = dataclasses.replace(
            state,
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=model_state,
        )
        return new_state, metrics

    return train_step_gradient, train_step_update


def make_accumulate(graphdef: nnx.GraphDef[Any], rest: nnx.State[Any, Any]) -> Accumulate:
    """accumulate(params, model_state, aux) -> the model state after one micro-batch: the
    model's `accumulate_model_state(aux)` (models.ModelStateLM, optional) on a copy; the state
    unchanged for a model without it or without ModelState."""

    def accumulate(params: Params, model_state: ModelStates, aux: dict[str, jax.Array]) -> Any:
        if not jax.tree.leaves(model_state):
            return model_state
        model = nnx.merge(graphdef, params, model_state, rest, copy=True)
        if not hasattr(model, "accumulate_model_state"):
            return model_state
        model.accumulate_model_state(aux)
        return nnx.state(model, ModelState)

    return accumulate


def accumulated_value_and_grad(
    loss_fn: LossFn,
    n: int,
    param_shardings: Any = None,
    batch_sharding: NamedSharding | None = None,
    accumulate: Accumulate | None = None,
) -> GradFn:
    """jax.value_and_grad(loss_fn, has_aux=True) of the whole batch, computed as a lax.scan
    over n micro-batches of B / n rows: one micro-batch's activations live at a time.

    Micro-batch i's loss is nll_sum_i / C + added_loss_i / n, with C the counted targets of the
    whole batch, so the micro-batch losses sum to the whole batch's CE exactly (micro-batches
    with more padding weigh less, as their targets do in the unsplit mean) plus the model's
    added losses (moe_loss, extra_loss) averaged over micro-batches. moe_loss is a
    per-micro-batch statistic (as in MaxText and Megatron-Core); a model's extra loss over
    counted targets (MTP) is exact: each micro-batch's loss_fn sees the whole batch (its target
    mask and segment ids) and divides its sums by the whole batch's counts / n, so their mean
    is the unsplit batch's (models.TargetsLM).
    ce and nll_sum/count are the whole batch's; the model's aux outputs (moe_loss, mtp_loss,
    expert_load, ...) are the mean over micro-batches, but counts (keys ending in _counts:
    expert_counts) their sum, the whole batch's. Gradients accumulate in float32 (or wider
    params' dtype) and come back in the params' dtype.

    accumulate (`make_accumulate`): the model state each micro-batch sees is the one the
    previous micro-batches left (a router's global-batch load buffer); without it every
    micro-batch reads the step's model state.
    """

    def micro_loss(
        params: Params, micro: Batch, total: jax.Array, model_state: ModelStates, step: Batch
    ) -> tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]:
        _, (_, aux, nll_sum, _) = loss_fn(params, micro, model_state, step)
        return nll_sum / total + added_loss(aux) / n, (aux, nll_sum)

    micro_grad = jax.value_and_grad(micro_loss, has_aux=True)

    def pin(grads: Params) -> Params:
        if param_shardings is None:
            return grads
        # Without it XLA may pick any sharding for the scan's carry (a replicated f32 copy of
        # every gradient); pinned, it is sharded exactly like the params.
        pinned: Params = jax.tree.map(jax.lax.with_sharding_constraint, grads, param_shardings)
        return pinned

    def value_and_grad(
        params: Params, batch: Batch, model_state: ModelStates = None
    ) -> tuple[tuple[jax.Array, LossAux], Params]:
        count = jnp.sum(target_mask(batch), dtype=jnp.float32)
        total = jnp.maximum(count, 1.0)
        micro = {k: split_micro_batches(v, n, batch_sharding) for k, v in batch.items()}

        def body(carry: tuple[Params, Any], mb: Batch) -> tuple[Any, tuple[Any, ...]]:
            acc, ms = carry
            (_, (aux, nll_sum)), grads = micro_grad(params, mb, total, ms, batch)
            acc = pin(jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads))
            if accumulate is not None:
                ms = accumulate(params, ms, aux)
            return (acc, ms), (aux, nll_sum)

        zeros = pin(jax.tree.map(lambda p: jnp.zeros(p.shape, _acc_dtype(p)), params))
        (acc, _), (auxs, nll_sums) = jax.lax.scan(body, (zeros, model_state), micro)
        grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
        # Counts (expert_counts) add up over the micro-batches, exactly (integers in float32);
        # every other aux output is the micro-batches' mean.
        aux = {
            k: jnp.sum(v, axis=0) if k.endswith("_counts") else jnp.mean(v, axis=0)
            for k, v in auxs.items()
        }
        nll_sum = jnp.sum(nll_sums)
        ce = nll_sum / total
        return (ce + added_loss(aux), (ce, aux, nll_sum, count)), grads

    return value_and_grad


def _acc_dtype(p: jax.Array) -> Any:
    """float32 for bf16/f32 params (a bf16 sum of N gradients would round each addition)."""
    return jnp.promote_types(p.dtype, jnp.float32)


def split_micro_batches(
    x_BX: jax.Array, n: int, batch_sharding: NamedSharding | None = None
) -> jax.Array:
    """[B, ...] -> [n, B / n, ...], micro-batch i = rows i, n + i, 2n + i, ...

    Strided, not contiguous: each device's contiguous block of rows splits evenly over the
    micro-batches, so every micro-batch keeps the batch's sharding (over dim 1) and the split
    moves no data. batch_sharding (the batch's, dim 0 over the batch axes) pins the result."""
    b = x_BX.shape[0]
    if b % n:
        raise ValueError(f"batch of {b} rows does not split into {n} equal micro-batches")
    x_NMX = jnp.swapaxes(x_BX.reshape(b // n, n, *x_BX.shape[1:]), 0, 1)
    if batch_sharding is None:
        return x_NMX
    # jax: PartitionSpec.__new__ and with_sharding_constraint are unannotated.
    spec = PartitionSpec(None, *batch_sharding.spec)  # type: ignore[no-untyped-call]
    sharding = NamedSharding(batch_sharding.mesh, spec)
    y: jax.Array = jax.lax.with_sharding_constraint(x_NMX, sharding)  # type: ignore[no-untyped-call]
    return y


def make_eval_step(
    graphdef: nnx.GraphDef[Any],
    rest: nnx.State[Any, Any],
    micro_batches: int = 1,
    batch_sharding: NamedSharding | None = None,
) -> Callable[[Params, Batch, ModelStates], Metrics]:
    """eval_step(params, batch, model_state=None): eval_loss (ce + added_loss: moe_loss and the
    model's extra_loss, as the train step's loss) and eval_ce_loss of the batch,
    eval_nll_sum / eval_tokens for a token-weighted CE (perplexity) across batches, and
    eval_<name> for each unweighted extra loss term a models.TargetsLM names in loss_terms
    (DeepSeek-V3's eval_mtp_loss).

    micro_batches N > 1 (train.grad_accum_steps) evaluates the batch as a lax.scan over N
    micro-batches split like the train step's, so eval fits wherever a train micro-batch does:
    nll_sum and tokens are summed (ce is the whole batch's), the added loss and the terms are
    the micro-batches' mean, as in the accumulated train step (exact for terms over counted
    targets, which the model normalises by the whole batch's counts)."""
    loss_fn = make_loss_fn(graphdef, rest)

    def loss_terms(params: Params, model_state: ModelStates) -> tuple[str, ...]:
        states = (params, rest) if model_state is None else (params, model_state, rest)
        model = nnx.merge(graphdef, *states)
        if isinstance(model, TargetsLM) and model.reads_targets:
            return tuple(model.loss_terms)
        return ()

    def metrics(nll_sum: jax.Array, count: jax.Array, extra: jax.Array, terms: Metrics) -> Metrics:
        ce = nll_sum / jnp.maximum(count, 1.0)
        return {
            "eval_loss": ce + extra,
            "eval_ce_loss": ce,
            "eval_nll_sum": nll_sum,
            "eval_tokens": count,
            **{f"eval_{k}": v for k, v in terms.items()},
        }

    def eval_step(params: Params, batch: Batch, model_state: ModelStates = None) -> Metrics:
        names = loss_terms(params, model_state)
        if micro_batches == 1:
            _, (_, aux, nll_sum, count) = loss_fn(params, batch, model_state)
            return metrics(nll_sum, count, added_loss(aux), {k: aux[k] for k in names})
        micro = {k: split_micro_batches(v, micro_batches, batch_sharding) for k, v in batch.items()}

        def body(carry: None, mb: Batch) -> tuple[None, tuple[Any, ...]]:
            _, (_, aux, nll_sum, count) = loss_fn(params, mb, model_state, batch)
            return carry, (nll_sum, count, added_loss(aux), {k: aux[k] for k in names})

        _, (nll_sums, counts, extras, terms) = jax.lax.scan(body, None, micro)
        means = {k: jnp.mean(v) for k, v in terms.items()}
        return metrics(jnp.sum(nll_sums), jnp.sum(counts), jnp.mean(extras), means)

    return eval_step
