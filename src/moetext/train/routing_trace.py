"""train.routing_trace: every MoE layer's chosen experts for a window of steps, for offline
analysis (which tokens go where, how routing changes over training).

For each step n of the window (numbered as the log numbers steps, stop inclusive) process 0
writes RUN_DIR/routing_trace/step_<n>.npz, key layer_<i> (i: the decoder layer) -> int32
[B, S, K] global expert ids of that step's global batch, row-major like the batch.

The ids come from a second jitted program, the model's forward traced inside
`moe.block.capture_expert_ids()` (its MoE blocks then add their ids to the aux), run on the
step's batch with the params and model state the step starts from: the routing the step
used. The train step itself is not changed, so a run without the window compiles and runs
exactly what it did before; with the window the trace program is compiled once, before the
step clock starts, and costs one forward per traced step (those intervals' tokens/s drop).

With train.grad_accum_steps = N the forward runs micro-batch by micro-batch, split exactly as
the train step splits the batch (rows i, N + i, 2N + i, ... in micro-batch i), each reading the
step's model state, and the ids are put back in the batch's row order. Micro-batches matter
where routing depends on the token's place in what the router sees: `routing_override`
balanced numbers tokens within a micro-batch, and random draws per micro-batch. Only the
global-batch loss buffer changes between micro-batches, which never changes routing.

Multi-process: every process runs the program (it is SPMD); its output is pinned replicated
(the program all-gathers the ids, int32 [N_moe, B, S, K], onto every device) and process 0
writes its own copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from moetext.models import HiddenStatesLM
from moetext.models.moe.block import IDS_KEY, capture_expert_ids
from moetext.program import Built, TrainState, lower_checked
from moetext.program.step import split_micro_batches

Batch = dict[str, jax.Array]


def make_expert_ids_fn(
    graphdef: nnx.GraphDef[Any],
    rest: nnx.State[Any, Any],
    micro_batches: int = 1,
    batch_sharding: Any = None,
) -> Any:
    """expert_ids(params, batch, model_state) -> int32 [N_moe, B, S, K]: each MoE layer's
    chosen experts for the batch's inputs (tokens[:, :-1]); to be traced (jitted) inside
    `capture_expert_ids()`. micro_batches > 1 routes the batch as the accumulated train step
    does (see the module docstring)."""

    def forward(params: Any, batch: Batch, model_state: Any) -> jax.Array:
        states = (params, rest) if model_state is None else (params, model_state, rest)
        model = nnx.merge(graphdef, *states)
        tokens_BS = batch["tokens"][:, :-1]
        inputs = {
            "positions_BS": batch["positions"][:, :-1],
            "segment_ids_BS": batch["segment_ids"][:, :-1],
        }
        # hidden_states skips the LM head; the rest of the forward past the last router is
        # dead code that XLA removes.
        if isinstance(model, HiddenStatesLM):
            _, aux = model.hidden_states(tokens_BS, **inputs)
        else:
            _, aux = model(tokens_BS, **inputs)
        if IDS_KEY not in aux:
            raise ValueError(
                f"the model's aux has no {IDS_KEY!r}: trace it inside capture_expert_ids()"
            )
        ids_LTK: jax.Array = aux[IDS_KEY]
        b, s = tokens_BS.shape
        return ids_LTK.reshape(ids_LTK.shape[0], b, s, ids_LTK.shape[-1])

    def expert_ids(params: Any, batch: Batch, model_state: Any = None) -> jax.Array:
        n = micro_batches
        if n == 1:
            return forward(params, batch, model_state)
        micro = {k: split_micro_batches(v, n, batch_sharding) for k, v in batch.items()}

        def body(carry: None, mb: Batch) -> tuple[None, jax.Array]:
            return carry, forward(params, mb, model_state)

        _, ids_NLMSK = jax.lax.scan(body, None, micro)
        # Micro-batch i row m is the batch's row m * n + i (split_micro_batches).
        ids_LMNSK = jnp.transpose(ids_NLMSK, (1, 2, 0, 3, 4))
        sh = ids_LMNSK.shape
        return ids_LMNSK.reshape(sh[0], sh[1] * sh[2], *sh[3:])

    return expert_ids


class RoutingTrace:
    """`due(n)`: step n (as logged) is in the window; `run(state, batch)` dispatches the
    trace forward of the step about to run on `batch`; `write(n, ids)` gathers and writes it.
    Without a window nothing is built or compiled."""

    def __init__(self, b: Built, run_dir: epath.PathLike, moe_pattern: Sequence[bool]):
        self._window = b.cfg.train.routing_trace
        self._b = b
        self._dir = epath.Path(run_dir) / "routing_trace"
        self._layer_ids = [i for i, is_moe in enumerate(moe_pattern) if is_moe]
        self._fn: Any = None
        if self._window is not None:
            fn = make_expert_ids_fn(
                b.graphdef, b.rest, b.cfg.train.grad_accum_steps, b.batch_sharding
            )
            shardings = b.state_shardings
            # Replicated out: every process then holds the whole batch's ids on its own
            # devices (one all-gather in the program). Left to XLA, the output's sharding is
            # not pinned, and gathering it afterwards is easy to get wrong across processes.
            self._fn = jax.jit(
                fn,
                in_shardings=(shardings.params, b.batch_sharding, shardings.model_state),
                out_shardings=b.plan.replicated,
            )

    def due(self, step: int) -> bool:
        if self._window is None:
            return False
        start, stop = self._window
        return start <= step <= stop

    def compile(self, state: TrainState, batch: Batch, first: int, last: int) -> None:
        """Compiles the trace program when a step of [first, last] is in the window (a no-op
        otherwise), so that no traced step's time includes compilation."""
        if self._window is None or self._window[0] > last or self._window[1] < first:
            return
        with capture_expert_ids():
            lowered = lower_checked(self._b, self._fn, state.params, batch, state.model_state)
        self._fn = lowered.compile()

    def run(self, state: TrainState, batch: Batch) -> jax.Array:
        """The trace forward of `batch` from `state` (dispatched, not waited for)."""
        with capture_expert_ids(), self._b.plan.rules():
            ids: jax.Array = self._fn(state.params, batch, state.model_state)
        return ids

    def write(self, step: int, ids_LBSK: jax.Array) -> None:
        """Process 0 writes step_<step>.npz (the ids are replicated: its first device's copy)."""
        if jax.process_index() != 0:
            return
        host = np.asarray(ids_LBSK.addressable_data(0), np.int32)
        if host.shape[0] != len(self._layer_ids):
            raise ValueError(
                f"routing trace has {host.shape[0]} MoE layers, the family's pattern "
                f"{len(self._layer_ids)} ({self._layer_ids})"
            )
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / f"step_{step}.npz"
        tmp = self._dir / f"step_{step}.npz.tmp"
        # Written whole, then renamed: a killed run leaves no torn step file.
        with tmp.open("wb") as f:
            np.savez(f, **{f"layer_{i}": host[n] for n, i in enumerate(self._layer_ids)})
        tmp.rename(path)
