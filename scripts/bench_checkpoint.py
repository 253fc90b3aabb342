"""Do async checkpoints stay async? Step times of the real training loop with checkpointing
every N steps against checkpointing disabled, in one process, arms alternating.

    .venv/bin/python scripts/bench_checkpoint.py configs/models/bench-tiny-moe.yml \
        [key=value ...] [--steps 60] [--every 20] [--repeats 2] [--out bench.json]

Each arm runs `train.run` to --steps with log_every=1, so metrics.jsonl holds every step's
time. Compared: the median step time of the steps that start no save (a save is started after
step k*every; its blocking part, the device->host copy, lands in step k*every+1), skipping the
first --skip steps after compilation. The steps that start a save are reported on their own.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import config as config_lib
from moetext import train


def run_arm(args: argparse.Namespace, every: int | None, run_dir: str) -> dict[int, float]:
    """{step: step_time_s} of one training run (every=None: checkpointing off)."""
    ckpt = [
        "checkpoint.enabled=true",
        f"checkpoint.every={every}",
        "checkpoint.async_save=true",
        "checkpoint.keep=2",
    ]
    cfg = config_lib.load(
        args.config,
        [
            *args.overrides,
            f"train.run_dir={run_dir}",
            f"train.steps={args.steps}",
            "train.log_every=1",
            "train.eval_every=0",
            "train.progress_bar=false",
            "train.tensorboard=false",
            "train.peak_tflops=1.0",  # no peak measurement: it is not what this compares
            *(ckpt if every else ["checkpoint.enabled=false"]),
        ],
    )
    train.run(cfg)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20, help="checkpoint.every of the 'on' arm")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, order alternating")
    p.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()

    times: dict[str, list[float]] = {"off": [], "on": []}
    save_start: list[float] = []
    saves = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = ["off", "on"] if rep % 2 == 0 else ["on", "off"]
            for arm in order:
                run_dir = os.path.join(tmp, f"{arm}{rep}")
                every = args.every if arm == "on" else None
                per_step = run_arm(args, every, run_dir)
                for step, t in per_step.items():
                    if step <= args.skip:
                        continue
                    if (step - 1) % args.every == 0 and step > 1:  # starts a save when "on"
                        if arm == "on":
                            save_start.append(t)
                        continue  # left out of both arms alike
                    times[arm].append(t)
                if arm == "on":
                    saves += len(os.listdir(os.path.join(run_dir, "checkpoints")))
    off, on = float(np.median(times["off"])), float(np.median(times["on"]))
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "every": args.every,
        "repeats": args.repeats,
        "median_step_s_checkpoint_off": off,
        "median_step_s_checkpoint_on": on,
        "ratio_on_over_off": on / off,
        "steps_compared_per_arm": len(times["on"]),
        "median_step_s_starting_a_save": float(np.median(save_start)) if save_start else None,
        "checkpoints_kept_per_on_run": saves / args.repeats,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
