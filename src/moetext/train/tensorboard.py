"""TensorBoard sink: <run_dir>/tensorboard/ event files (tensorboardX; process 0 only).

Every numeric field of a metrics row becomes a scalar at its step; a per-layer expert load
[num_moe_layers, E] becomes one histogram per MoE layer, tag expert_load/layer_<i>, whose
bucket e (x = expert id) holds the fraction of that layer's routed assignments expert e got;
a biased router's selection bias [num_moe_layers, E] a histogram of its values per layer.
View with `tensorboard --logdir RUN_DIR`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

SUBDIR = "tensorboard"


class TensorBoardSink:
    """Writes scalars and expert-load histograms; a resumed run hides the events it replays."""

    def __init__(self, run_dir: str, start_step: int):
        from tensorboardX import SummaryWriter

        # purge_step: events of an interrupted run after the checkpoint it resumes from are
        # hidden, so the curves read as one run (as metrics.jsonl does).
        self._w = SummaryWriter(os.path.join(run_dir, SUBDIR), purge_step=start_step + 1)

    def write(
        self,
        step: int,
        scalars: Mapping[str, float],
        expert_load: np.ndarray | None = None,
        layer_ids: Sequence[int] = (),
        *,
        bias: np.ndarray | None = None,
    ) -> None:
        """bias: a biased router's selection bias [num_moe_layers, E], written as a histogram of
        its values per layer (selection_bias/layer_<i>)."""
        for tag, value in scalars.items():
            self._w.add_scalar(tag, value, step)
        if expert_load is not None:
            for i, load_E in zip(layer_ids, expert_load, strict=True):
                self._histogram(f"expert_load/layer_{i}", np.asarray(load_E, np.float64), step)
        if bias is not None:
            for i, bias_E in zip(layer_ids, bias, strict=True):
                self._w.add_histogram(
                    f"selection_bias/layer_{i}", np.asarray(bias_E, np.float64), step
                )
        self._w.flush()

    def _histogram(self, tag: str, load_E: np.ndarray, step: int) -> None:
        e = len(load_E)
        ids = np.arange(e, dtype=np.float64)
        self._w.add_histogram_raw(
            tag,
            min=0.0,
            max=float(e - 1),
            num=float(load_E.sum()),
            sum=float((ids * load_E).sum()),
            sum_squares=float((ids**2 * load_E).sum()),
            bucket_limits=list(ids + 0.5),  # bucket e: (e - 0.5, e + 0.5]
            bucket_counts=list(load_E),
            global_step=step,
        )

    def close(self) -> None:
        self._w.close()


def numeric(record: Mapping[str, object]) -> dict[str, float]:
    """The record's numeric fields (not step, events or strings) as floats."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }
