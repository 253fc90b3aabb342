"""`train.profile_steps: [start, stop]`: a jax.profiler trace of those steps.

Steps are numbered as the log numbers them (step n is the n-th optimizer update), stop
exclusive. The trace goes to <run_dir>/tensorboard/plugins/profile/<timestamp>/ on the processes
in `train.profile_processes` (process 0 by default): `*.xplane.pb` for TensorBoard's
profile plugin (`tensorboard --logdir RUN_DIR`, pip install tensorboard-plugin-profile) and
`perfetto_trace.json.gz` for https://ui.perfetto.dev. A resumed run whose first step falls
inside the window traces the rest of it. The loop waits for the device at both ends of the
window (only there), so the trace holds exactly the window's steps.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from moetext.train.tensorboard import SUBDIR


class StepProfiler:
    """Starts the trace before the window's first step and stops it after its last one."""

    def __init__(self, window: tuple[int, int] | None, processes: tuple[int, ...], run_dir: str):
        mine = window is not None and jax.process_index() in processes
        self.window = window if mine else None
        self.log_dir = os.path.join(run_dir, SUBDIR)
        self.active = False

    def before_step(self, step: int, state: Any) -> str | None:
        """Called before step `step` runs (state: the latest train state, to wait on). Returns
        a line for the log when the trace starts or stops."""
        if self.window is None:
            return None
        start, stop = self.window
        if not self.active and start <= step < stop:
            # Earlier steps stay out of the trace (jax: block_until_ready is unannotated).
            jax.block_until_ready(state)  # type: ignore[no-untyped-call]
            jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.active = True
            return f"profiler: tracing steps {step}..{stop - 1} into {self.log_dir}"
        if self.active and step >= stop:
            return self.stop(state)
        return None

    def stop(self, state: Any) -> str | None:
        """Ends the trace (after the window, or when the run ends inside it)."""
        if not self.active:
            return None
        try:
            # The last step's work belongs to the trace (jax: block_until_ready is unannotated).
            jax.block_until_ready(state)  # type: ignore[no-untyped-call]
        finally:  # also when the run is failing (its error is what the user must see)
            jax.profiler.stop_trace()
        self.active = False
        return f"profiler: trace written under {os.path.join(self.log_dir, 'plugins', 'profile')}"
