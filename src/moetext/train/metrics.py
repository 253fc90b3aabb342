"""Throughput, MFU and the metrics sinks (terminal progress bar + <run_dir>/metrics.jsonl)."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def measured_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """Dense bf16 matmul FLOP/s of one device of this machine (median of `reps` runs)."""
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), dev)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(times))


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float, num_devices: int) -> float:
    return flops_per_token * tokens_per_s / (peak_flops * num_devices)


class MetricsLog:
    """Appends one JSON object per logged step and drives the progress bar."""

    def __init__(self, run_dir: str, total_steps: int, start_step: int, progress_bar: bool):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a")  # noqa: SIM115  (closed in close())
        self._bar = None
        if progress_bar and jax.process_index() == 0:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        if jax.process_index() == 0:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._bar is not None:
            keys = [k for k in ("loss", "eval_loss", "tokens_per_s", "mfu") if k in record]
            self._bar.set_postfix({k: _short(record[k]) for k in keys}, refresh=False)
        elif jax.process_index() == 0:
            shown = " ".join(f"{k}={_short(v)}" for k, v in record.items())
            print(shown, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()


def _plain(v):
    if isinstance(v, jax.Array | np.ndarray | np.generic):
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else v
