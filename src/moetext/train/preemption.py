"""Preemption: SIGTERM / SIGINT finish the current step, checkpoint it, and end the run cleanly.

The first signal only sets a flag; the loop asks `should_stop(step)` after every step and, when
it answers True, saves a checkpoint at that step (even between `checkpoint.every` multiples) and
returns. The first signal also puts the previous handlers back, so a second Ctrl-C raises
KeyboardInterrupt at once.

Every process must stop at the same step (a checkpoint is a collective write), but a signal may
reach only one host. Two agreements, both cheap:

- SIGTERM under jax.distributed with JAX's preemption service (the default): the service's own
  handler receives it and agrees on a step in the background; `reached_preemption` (orbax, over
  `multihost_utils.reached_preemption_sync_point`) is a local check, asked every step. We leave
  its SIGTERM handler in place.
- Otherwise (SIGINT, or SIGTERM without the service) each process only has its own flag; with
  several processes they OR their flags with one tiny all-gather every `sync_every` steps (the
  loop's log interval, where it waits for the device anyway), never every step.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax._src import distributed

from moetext.checkpoint import Checkpointer
from moetext.train.metrics import MetricsLog

_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}


class Preemption:
    """Signal handlers for one `run`; `close()` restores the previous ones."""

    def __init__(self, sync_every: int):
        self.sync_every = sync_every
        self.received: str | None = None  # name of the first signal, set by the handler
        self._service = distributed.global_state.preemption_sync_manager is not None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal only works in the main thread; run without handlers
        for sig in _SIGNALS:
            if sig == signal.SIGTERM and self._service:
                continue  # JAX's preemption notifier owns SIGTERM (see the module docstring)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = _SIGNALS[signal.Signals(signum)]
        self._restore()  # a second signal acts as if we were not here: exits at once
        if jax.process_index() == 0:
            print(
                f"\n{self.received}: finishing the current step, then saving a checkpoint "
                f"(send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )

    def should_stop(self, step: int) -> bool:
        """Whether to checkpoint `step` (steps done) and stop; every process answers the same."""
        if self._service and _reached_preemption(step):
            self.received = self.received or "SIGTERM"
            return True
        if jax.process_count() == 1:
            return self.received is not None
        if step % self.sync_every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received is not None))
        if np.any(flags):
            self.received = self.received or "a signal on another process"
            return True
        return False

    def finish(self, step: int, ckpt: Checkpointer | None, log: MetricsLog) -> None:
        """Waits for `step`'s checkpoint to be complete on disk; logs one line naming it."""
        if ckpt is not None:
            ckpt.wait()
            saved = f"saved checkpoint {ckpt.directory}/{step}"
        else:
            saved = "checkpoint.enabled=false, nothing saved"
        log.write({"step": step, "event": "preempted", "signal": self.received})
        log.info(f"{self.received}: stopped after step {step}; {saved}")

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def close(self) -> None:
        self._restore()


def _reached_preemption(step: int) -> bool:
    import orbax.checkpoint as ocp

    return bool(ocp.multihost.reached_preemption(step))
