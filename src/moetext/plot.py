"""`python -m moetext.plot RUN_DIR [RUN_DIR ...] [--metric NAME ...] [--out curves.png]`.

Training curves against step, one line per run, read from each run's metrics.jsonl: loss, eval
loss, learning rate and tokens/s, or with `--metric NAME` (repeatable) one panel per named
metric instead (any numeric key of the rows, e.g. max_vio/layer_1). Bad input (a missing
directory, no metrics, a metric no run logged) is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

from moetext import paths

PANELS = (
    ("loss", "train loss"),
    ("eval_loss", "eval loss"),
    ("lr", "learning rate"),
    ("tokens_per_s", "tokens/s"),
)


class PlotError(ValueError):
    """A run directory that cannot be plotted (missing, or without metrics)."""


Series = dict[str, tuple[list[int], list[float]]]  # {metric: (steps, values)}


DEFAULT_KEYS = tuple(k for k, _ in PANELS)


def read_series(run_dir: str, keys: Sequence[str] = DEFAULT_KEYS) -> Series:
    """{metric: (steps, values)} of `keys` in run_dir/metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise PlotError(f"{run_dir}: no such run directory")
    if not os.path.isfile(path):
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a run directory, or not logged yet)")
    series: Series = {k: ([], []) for k in keys}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
            for key, (steps, values) in series.items():
                v = row.get(key)
                if isinstance(v, int | float) and "step" in row:
                    steps.append(int(row["step"]))
                    values.append(float(v))
    if not any(steps for steps, _ in series.values()):
        logs = ""
        if tuple(keys) != DEFAULT_KEYS:
            logs = f"; it logs: {', '.join(numeric_keys(run_dir))}"
        raise PlotError(f"{path}: no logged steps ({', '.join(keys)}){logs}")
    return series


def numeric_keys(run_dir: str) -> list[str]:
    """The numeric metrics (besides step) that run_dir/metrics.jsonl logs, sorted."""
    keys: set[str] = set()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            keys.update(k for k, v in row.items() if isinstance(v, int | float) and k != "step")
    return sorted(keys)


def plot(run_dirs: Sequence[str], out: str, metrics: Sequence[str] = ()) -> None:
    """Draws the four panels (or one per name in `metrics`) for every run into the PNG `out`."""
    panels = [(m, m) for m in dict.fromkeys(metrics)] if metrics else list(PANELS)
    runs = [(run_dir, read_series(run_dir, [k for k, _ in panels])) for run_dir in run_dirs]
    unlogged = [k for k, _ in panels if not any(s[k][0] for _, s in runs)]
    if metrics and unlogged:
        known = sorted({k for run_dir in run_dirs for k in numeric_keys(run_dir)})
        raise PlotError(
            f"--metric {', '.join(unlogged)}: not logged by {', '.join(run_dirs)}; "
            f"logged: {', '.join(known)}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / cols)
    fig, axes_grid = plt.subplots(
        rows, cols, figsize=(5.5 * cols, 3.5 * rows), sharex=True, squeeze=False
    )
    axes = list(axes_grid.flat)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, (key, title) in zip(axes, panels, strict=False):
        for run_dir, series in runs:
            steps, values = series[key]
            label = _label(run_dir)
            ax.plot(steps, values, marker="o" if len(steps) < 3 else None, ms=3, label=label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if not any(series[key][0] for _, series in runs):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
    for i, ax in enumerate(axes[: len(panels)]):
        if i + cols >= len(panels):  # the lowest panel of its column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), frameon=False)
    legend_rows = math.ceil(len(runs) / 4)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 * legend_rows * 2 / rows))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _label(run_dir: str) -> str:
    """The run dir as the legend names it: relative to the working directory when under it."""
    rel = os.path.relpath(run_dir)
    return run_dir if rel.startswith("..") else rel


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moetext.plot",
        description="Plot loss, eval loss, learning rate and tokens/s (or the --metric names) "
        "of one or more runs.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a metrics.jsonl key to plot instead of the default panels, one panel each "
        "(repeatable), e.g. --metric max_vio/layer_1",
    )
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    args = p.parse_args(argv)
    try:
        # Absolute at the boundary (~ expanded: the shell does not in --out=~/x).
        run_dirs = [os.fspath(paths.existing_dir(d, "RUN_DIR")) for d in args.run_dirs]
        out = os.fspath(paths.writable_file(args.out, "--out"))
        plot(run_dirs, out, args.metric)
    except (PlotError, paths.PathError) as e:
        print(f"moetext.plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
