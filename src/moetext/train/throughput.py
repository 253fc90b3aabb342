"""Throughput and MFU: the mean step time over each logging interval, tokens/s, and model FLOPs
utilisation against the device's peak (train/peak.py).

The loop waits for the device only when it logs, so a step time is the wall time since the
last log (or since compilation finished) over the steps taken in between: real device time,
measured without a host sync per step. What the loop does between steps that is not training
(a checkpoint save, an evaluation) runs inside `apart(name)`: its wall time is taken out of the
interval and logged on its own as `<name>_time_s`, so step_time_s, tokens_per_s and mfu
measure training steps only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import jax

from moetext.config import Config
from moetext.models.flops import flops_per_token
from moetext.train import peak as peak_lib
from moetext.train.peak import Peak


def mfu(flops_per_token: float, tokens_per_s: float, peak: Peak, num_devices: int) -> float:
    """Model FLOP/s per device over the peak; the peak rises instead of MFU exceeding 1."""
    return peak.mfu(flops_per_token * tokens_per_s / num_devices)


class Throughput:
    """Times the steps between two logs; `fields()` gives a metrics row's step_time_s,
    tokens_per_s and mfu (model FLOPs: the family's count, models/flops.py)."""

    def __init__(self, cfg: Config):
        self.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
        self.peak = peak_lib.select(cfg.train.peak_tflops)
        self.restart()

    def restart(self) -> None:
        """Starts a new interval now (after compiling, after each log)."""
        self._t_last, self._steps = time.perf_counter(), 0
        self._apart: dict[str, float] = {}
        self._excluded = 0.0  # every apart block's time in this interval, reported or taken

    def step(self) -> None:
        """One more step dispatched in this interval."""
        self._steps += 1

    @contextlib.contextmanager
    def apart(self, name: str) -> Iterator[None]:
        """Times the block as `<name>_time_s`, outside the steps' time. The caller waits for
        the steps dispatched before it first (their time is the steps')."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key, dt = f"{name}_time_s", time.perf_counter() - t0
            self._apart[key] = self._apart.get(key, 0.0) + dt
            self._excluded += dt

    def take(self, name: str) -> float:
        """The time of the `name` blocks so far, for a row of their own: `fields` no longer
        reports it, but still leaves it out of the steps' time."""
        return self._apart.pop(f"{name}_time_s", 0.0)

    def fields(self) -> dict[str, float]:
        """The interval's mean step time, tokens/s and MFU, and the time of each `apart` block
        in it; call it after waiting for the interval's last step (jax.device_get of its
        metrics), so the time is real."""
        dt = (time.perf_counter() - self._t_last - self._excluded) / self._steps
        tps = self.tokens_per_step / dt
        return {
            "step_time_s": dt,
            "tokens_per_s": tps,
            "mfu": mfu(self.flops_per_token, tps, self.peak, jax.device_count()),
            **self._apart,
        }
