"""Throughput and MFU: the mean step time over each logging interval, tokens/s, and model FLOPs
utilisation against the device's peak (train/peak.py).

The loop waits for the device only when it logs, so a step time is the wall time since the
last log (or since compilation finished) over the steps taken in between: real device time,
measured without a host sync per step.
"""

from __future__ import annotations

import time

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

    def step(self) -> None:
        """One more step dispatched in this interval."""
        self._steps += 1

    def fields(self) -> dict[str, float]:
        """The interval's mean step time, tokens/s and MFU; call it after waiting for the
        interval's last step (jax.device_get of its metrics), so the time is real."""
        dt = (time.perf_counter() - self._t_last) / self._steps
        tps = self.tokens_per_step / dt
        return {
            "step_time_s": dt,
            "tokens_per_s": tps,
            "mfu": mfu(self.flops_per_token, tps, self.peak, jax.device_count()),
        }
