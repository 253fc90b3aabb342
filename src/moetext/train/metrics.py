"""MFU and the metrics sinks: terminal progress bar, <run_dir>/metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import numpy.typing as npt
from etils import epath

from moetext.models.moe import LOAD_KEY  # expert_load [num_moe_layers, E] in a metrics row
from moetext.models.moe.block import COUNTS_KEY, DROPPED_KEY
from moetext.models.moe.routers import BIAS_KEY
from moetext.train.tensorboard import TensorBoardSink, numeric


def to_host(metrics: dict[str, Any]) -> dict[str, Any]:
    """Fetched step metrics: scalars as floats, arrays (expert_load) as NumPy arrays."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = float(a) if a.ndim == 0 else a
    return out


def imbalance(load_LE: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """max / mean expert load per layer: 1.0 is perfectly balanced, E is one expert takes all."""
    a_LE = np.asarray(load_LE, np.float64)
    out: npt.NDArray[np.float64] = a_LE.max(axis=-1) / np.maximum(a_LE.mean(axis=-1), 1e-30)
    return out


def max_violation(counts_LE: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """DeepSeek's MaxVio per layer: max load / mean load - 1 (0.0 is perfectly balanced)."""
    return imbalance(counts_LE) - 1.0


def per_layer_scalars(arrays: dict[str, np.ndarray], layer_ids: Sequence[int]) -> dict[str, float]:
    """A row's per-layer statistics ([num_moe_layers, ...] each) as the scalars metrics.jsonl
    keeps, tagged by decoder layer: expert_imbalance/layer_<i> (max / mean load),
    max_vio/layer_<i> (that - 1, over the non-padding tokens), dropped_fraction/layer_<i>
    (capacity dispatch), selection_bias_{min,max,std}/layer_<i> (biased routers). Other arrays
    (a routing trace's ids) are not scalars and are left out."""
    out: dict[str, float] = {}

    def put(name: str, values: npt.ArrayLike) -> None:
        for i, x in zip(layer_ids, np.asarray(values, np.float64), strict=True):
            out[f"{name}/layer_{i}"] = float(x)

    if LOAD_KEY in arrays:
        put("expert_imbalance", imbalance(arrays[LOAD_KEY]))
    if COUNTS_KEY in arrays:
        put("max_vio", max_violation(arrays[COUNTS_KEY]))
    if DROPPED_KEY in arrays:
        put("dropped_fraction", arrays[DROPPED_KEY])
    if BIAS_KEY in arrays:
        bias = np.asarray(arrays[BIAS_KEY], np.float64)
        put("selection_bias_min", bias.min(axis=-1))
        put("selection_bias_max", bias.max(axis=-1))
        put("selection_bias_std", bias.std(axis=-1))
    return out


class MetricsLog:
    """Appends one JSON object per logged step, mirrors it to TensorBoard, drives the bar.

    A row's per-layer arrays (expert_load, expert_counts, selection_bias, ... [num_moe_layers,
    ...]) become per-layer scalars (`per_layer_scalars`; i: the decoder layer, from
    moe_pattern; rows past its MoE layers, such as MTP layers', numbered on from its length) in
    metrics.jsonl and TensorBoard, and TensorBoard histograms of the expert
    load and the selection bias. On start, rows after start_step left by an interrupted run are
    dropped, so a resumed run's file reads as one run.
    """

    def __init__(
        self,
        run_dir: epath.PathLike,
        total_steps: int,
        start_step: int,
        progress_bar: bool,
        *,
        tensorboard: bool = False,
        moe_pattern: Sequence[bool] = (),
    ):
        self.path = epath.Path(run_dir) / "metrics.jsonl"
        self._layer_ids = [i for i, is_moe in enumerate(moe_pattern) if is_moe]
        self._num_layers = len(moe_pattern)
        self._tb: TensorBoardSink | None = None
        self._file: _Appender | None = None
        if jax.process_index() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_after(self.path, start_step)
            self._file = _Appender(self.path)
            if tensorboard:
                self._tb = TensorBoardSink(os.fspath(run_dir), start_step)
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

    def _row_layers(self, n: int) -> list[int]:
        """The decoder layer of each of n per-layer rows: the pattern's MoE layers, then rows
        past them numbered on from num_layers (layers a model runs after its stack, such as
        DeepSeek-V3's MTP layers, HF model.layers.{num_layers + k - 1}); 0..n-1 without a
        pattern that fits."""
        extra = n - len(self._layer_ids)
        if not self._layer_ids or extra < 0:
            return list(range(n))
        return self._layer_ids + list(range(self._num_layers, self._num_layers + extra))

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def info(self, line: str) -> None:
        """One line for the person watching (process 0), without breaking the bar."""
        if jax.process_index() != 0:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        arrays = {k: v for k, v in record.items() if isinstance(v, np.ndarray) and v.ndim}
        record = {k: v for k, v in record.items() if k not in arrays}
        layer_ids: list[int] = []
        if arrays:
            layer_ids = self._row_layers(len(next(iter(arrays.values()))))
        layer_scalars = per_layer_scalars(arrays, layer_ids)
        shown = dict(record)
        record.update(layer_scalars)
        if self._tb is not None:
            self._tb.write(
                int(record["step"]),
                numeric(record),
                arrays.get(LOAD_KEY),
                layer_ids,
                bias=arrays.get(BIAS_KEY),
            )
        record = {k: _plain(v) for k, v in record.items()}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._bar is not None:
            keys = [k for k in ("loss", "eval_loss", "tokens_per_s", "mfu") if k in record]
            self._bar.set_postfix({k: _short(record[k]) for k in keys}, refresh=False)
        elif jax.process_index() == 0:
            print(" ".join(f"{k}={_short(_plain(v))}" for k, v in shown.items()), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()


class _Appender:
    """Appends lines to a file. Local files are appended to and flushed; object stores (gs://)
    cannot append, so the file is rewritten whole from the lines kept in memory (one small
    write per logged step)."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._local = "://" not in os.fspath(path)
        if self._local:
            self._f = open(path, "a")  # noqa: SIM115  (closed in close())
        else:
            self._text = path.read_text() if path.exists() else ""

    def write(self, line: str) -> None:
        if self._local:
            self._f.write(line)
            self._f.flush()
        else:
            self._text += line
            self.path.write_text(self._text)

    def close(self) -> None:
        if self._local:
            self._f.close()


def truncate_after(path: epath.PathLike, step: int) -> None:
    """Rewrites metrics.jsonl (atomically) without rows after `step` or torn lines."""
    path = epath.Path(path)
    if not path.exists():
        return
    kept, dropped = [], False
    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run
                dropped = True
                continue
            if isinstance(row, dict) and row.get("step", 0) > step:
                dropped = True
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.parent / (path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _plain(v: Any) -> Any:
    """A JSON value: arrays and numpy scalars as Python numbers, nan/inf as strings."""
    if isinstance(v, jax.Array | np.ndarray | np.generic):
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _short(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else v
