"""The non-finite policy: a NaN/Inf loss or gradient norm stops the run, or with
train.skip_nonfinite_steps=N the step skips itself (inside the jitted step, see step.py) and the
run stops after more than N skips in a row. A checkpoint with non-finite values is never written.

The loop waits for the device only every log_every steps, so this module keeps each step's
metrics as device arrays (three scalars per step) and inspects them when the loop logs or is
about to save: no host sync per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moetext.train.metrics import MetricsLog


class NonFiniteError(RuntimeError):
    """Training produced a NaN/Inf loss or gradient norm (user-facing: the CLI prints one line)."""


_KEYS = ("loss", "grad_norm", "skipped")


class NonFiniteGuard:
    def __init__(
        self,
        skip_steps: int,
        last_checkpoint: Callable[[], str | None],
        log: MetricsLog,
    ):
        self.skip_steps = skip_steps
        self._last_checkpoint = last_checkpoint  # path of the newest checkpoint, or None
        self._log = log
        self._pending: list[tuple[int, dict[str, jax.Array]]] = []
        self._consecutive = 0  # skipped steps in a row, across checks

    def record(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Keeps `step`'s loss / grad_norm / skipped (device arrays; nothing waits)."""
        self._pending.append((step, {k: metrics[k] for k in _KEYS if k in metrics}))

    def check(self) -> None:
        """Inspects the steps recorded since the last check; raises NonFiniteError."""
        pending, self._pending = jax.device_get(self._pending), []
        for step, m in pending:
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            if math.isfinite(loss) and math.isfinite(gnorm):
                self._consecutive = 0
                continue
            if not self.skip_steps:
                self._fail(f"non-finite loss={loss} grad_norm={gnorm} at step {step}")
            self._consecutive += 1
            self._log.write({"step": step, "event": "skipped_nonfinite"})
            self._log.info(
                f"step {step}: non-finite loss={loss} grad_norm={gnorm}, update skipped "
                f"({self._consecutive} in a row, at most train.skip_nonfinite_steps="
                f"{self.skip_steps})"
            )
            if self._consecutive > self.skip_steps:
                self._fail(
                    f"{self._consecutive} consecutive steps with a non-finite loss or grad norm "
                    f"(more than train.skip_nonfinite_steps={self.skip_steps}), the last at "
                    f"step {step}"
                )

    def check_before_save(self, step: int, state: Any) -> None:
        """Raises unless every step so far was finite (or skipped) and `state` is all finite."""
        self.check()
        # Finite losses and gradients can still overflow the update (a huge learning rate):
        # one reduction over the state, only when saving.
        if not bool(_all_finite(state)):
            self._fail(f"non-finite parameters or optimizer state after step {step}")

    def _fail(self, what: str) -> None:
        last = self._last_checkpoint()
        where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
        hint = "raise" if self.skip_steps else "set"
        raise NonFiniteError(
            f"{what}; {where}. Lower optim.learning_rate, or {hint} "
            f"train.skip_nonfinite_steps=N to skip up to N such steps in a row"
        )


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
