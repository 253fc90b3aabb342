"""The peak FLOP/s that MFU divides by: given, published for the device kind, or measured.

Order: train.peak_tflops when given; else the published dense bf16 peak of the device kind
(TPU, NVIDIA H100/H200); else (CPU, other GPUs) a measurement: the best of several large
square bf16 matmuls after a warm-up. A measured peak is a lower bound of the true one, so when
the train step itself runs faster than it, the step's rate becomes the peak (MFU reads 1.0 and
a note says so) rather than reporting an MFU above 1. See docs/performance.md ("MFU").
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

# Dense (no sparsity) bf16 peak per JAX device, in TFLOP/s, matched as a substring of
# device.device_kind, first match wins (so "TPU v5 lite" comes before "TPU v5"). TPU figures are
# Google Cloud's per-chip numbers; v4 and v5p run megacore (one device per chip), TPU7x
# (Ironwood, 2307 per chip) shows each of its two TensorCores as a device. GPU figures are
# NVIDIA's dense bf16 tensor-core peaks (the SXM parts; the PCIe H100 is slower).
PUBLISHED_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0),
    ("TPU v5", 459.0),  # v5p reports "TPU v5"
    ("TPU v6 lite", 918.0),
    ("TPU v6e", 918.0),
    ("TPU7x", 2307.0 / 2),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
)


@dataclasses.dataclass
class Peak:
    """Peak FLOP/s of one device and where the number came from."""

    flops: float
    source: str
    raised: bool = False

    def describe(self) -> str:
        return f"mfu peak: {self.flops / 1e12:.3g} TFLOP/s per device ({self.source})"

    def fields(self) -> dict[str, float | str]:
        """For the run's "compiled" event row in metrics.jsonl."""
        return {"mfu_peak_tflops": self.flops / 1e12, "mfu_peak_source": self.source}

    def mfu(self, achieved_flops_per_device: float) -> float:
        """achieved / peak, never above 1: a faster step proves the peak was too low."""
        if achieved_flops_per_device > self.flops:
            old = self.describe()
            self.flops = achieved_flops_per_device
            self.source = "the train step's own rate, above the previous peak"
            if not self.raised and jax.process_index() == 0:
                print(
                    f"{old} is below what the train step achieves; using the step's rate "
                    f"{self.flops / 1e12:.3g} TFLOP/s as the peak (MFU 1.0) from here on",
                    file=sys.stderr,
                    flush=True,
                )
            self.raised = True
        return achieved_flops_per_device / self.flops


def published_tflops(device_kind: str) -> float | None:
    for name, tflops in PUBLISHED_BF16_TFLOPS:
        if name in device_kind:
            return tflops
    return None


def select(
    given_tflops: float | None,
    device_kind: str | None = None,
    *,
    measure: Callable[[], tuple[float, str]] | None = None,
    devices_sharing_host: int | None = None,
) -> Peak:
    """The peak for this run: given > published for device_kind > measured.

    device_kind defaults to jax.devices()[0]'s; measure (tests pass a fake) defaults to
    measure_matmul_flops. On CPU the measured matmul already uses every core, so the host's
    peak is split over the devices this process holds (devices_sharing_host, default
    jax.local_device_count() on CPU; XLA_FLAGS fake devices share the same cores).
    """
    if given_tflops:
        return Peak(given_tflops * 1e12, "train.peak_tflops")
    dev = jax.devices()[0]
    kind = dev.device_kind if device_kind is None else device_kind
    published = published_tflops(kind)
    if published is not None:
        return Peak(published * 1e12, f"published dense bf16 peak of {kind}")
    flops, how = (measure or measure_matmul_flops)()
    if devices_sharing_host is None:
        devices_sharing_host = jax.local_device_count() if dev.platform == "cpu" else 1
    if devices_sharing_host > 1:
        flops /= devices_sharing_host
        how += f", host peak split over {devices_sharing_host} devices"
    return Peak(flops, f"measured: {how}")


def measure_matmul_flops(n: int = 4096, reps: int = 5, budget_s: float = 5.0) -> tuple[float, str]:
    """Best (max) FLOP/s of an n^3 bf16 matmul on one device after a warm-up, and a label.

    The max, not the median: a peak is what the device can do, and noise only slows it down.
    Stops early (after at least two timed runs) once budget_s is spent, for slow hosts.
    """
    dev = jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16), dev)
    b = jax.device_put(jnp.full((n, n), 0.5, jnp.bfloat16), dev)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()  # compile + warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < reps and (runs < 2 or spent < budget_s):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return 2 * n**3 / best, f"bf16 {n}^3 matmul, best of {runs}"
