"""`python -m moetext.plot RUN_DIR [RUN_DIR ...] [--out curves.png]`: training curves.

Loss, eval loss, learning rate and tokens/s against step, one line per run, read from each
run's metrics.jsonl. Bad input (a missing directory, no metrics) is one line and exit code 2.
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


def read_series(run_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} of the panels' metrics in run_dir/metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise PlotError(f"{run_dir}: no such run directory")
    if not os.path.isfile(path):
        raise PlotError(f"{run_dir}: no metrics.jsonl (not a run directory, or not logged yet)")
    series: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k, _ in PANELS}
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
        raise PlotError(f"{path}: no logged steps ({', '.join(k for k, _ in PANELS)})")
    return series


def plot(run_dirs: Sequence[str], out: str) -> None:
    """Draws the four panels for every run into the PNG `out`."""
    runs = [(run_dir, read_series(run_dir)) for run_dir in run_dirs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
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
    for ax in axes[1]:
        ax.set_xlabel("step")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(runs), 4), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.04 * math.ceil(len(runs) / 4)))
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
        description="Plot loss, eval loss, learning rate and tokens/s of one or more runs.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    p.add_argument("--out", default="curves.png", help="PNG to write (default: curves.png)")
    args = p.parse_args(argv)
    try:
        # Absolute at the boundary (~ expanded: the shell does not in --out=~/x).
        run_dirs = [os.fspath(paths.existing_dir(d, "RUN_DIR")) for d in args.run_dirs]
        out = os.fspath(paths.writable_file(args.out, "--out"))
        plot(run_dirs, out)
    except (PlotError, paths.PathError) as e:
        print(f"moetext.plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
