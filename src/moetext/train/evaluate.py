"""Evaluation during training: every train.eval_every steps, the loss and perplexity of a fixed
set of eval batches (data.eval_batches: the same rows every time), and their unigram entropy
as a baseline that a model learning nothing but token frequencies would reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from moetext import data as data_lib
from moetext.data.batch import unigram_entropy
from moetext.program import Built, TrainState, jit_eval_step

Batch = dict[str, jax.Array]


class Evaluator:
    """`due(step)` says whether `step` evaluates; `__call__(state)` gives the eval_* fields of
    its metrics row. The eval batches are placed on the devices on first use, then kept."""

    def __init__(
        self,
        b: Built,
        data: data_lib.TrainData,
        put: Callable[[dict[str, np.ndarray]], Batch],
    ):
        self._b, self._data, self._put = b, data, put
        self._every = b.cfg.train.eval_every
        self._step = jit_eval_step(b)
        self._set: list[Batch] | None = None
        self._unigram = float("nan")  # of this process's eval rows

    def due(self, step: int) -> bool:
        return bool(self._every) and step % self._every == 0

    def __call__(self, state: TrainState) -> dict[str, float]:
        if self._set is None:
            self._set = [self._put(e) for e in self._data.eval_batches()]
            self._unigram = unigram_entropy(self._data.eval_batches())
        with self._b.plan.rules():  # eval traces on its first call
            out = evaluate(self._step, state.params, state.model_state, self._set)
        out["eval_unigram_entropy"] = self._unigram
        return out


def evaluate(
    eval_step: Callable[..., dict[str, jax.Array]],
    params: Any,
    model_state: Any,
    eval_set: list[Batch],
) -> dict[str, float]:
    """Mean eval_loss over the fixed batches; perplexity from the token-weighted CE; the mean
    over batches of each extra loss term the eval step reports (eval_mtp_loss), as eval_loss."""
    out = [jax.device_get(eval_step(params, batch, model_state)) for batch in eval_set]
    nll = sum(float(o["eval_nll_sum"]) for o in out)
    tokens = max(sum(float(o["eval_tokens"]) for o in out), 1.0)
    weighted = ("eval_nll_sum", "eval_tokens", "eval_ce_loss")
    means = {k: sum(float(o[k]) for o in out) / len(out) for k in out[0] if k not in weighted}
    return {
        **means,  # eval_loss and the terms
        "eval_ce_loss": nll / tokens,
        "eval_perplexity": float(np.exp(nll / tokens)),
    }
