"""The text input pipeline's speed, next to the trainer's, in one process.

    .venv/bin/python scripts/bench_data.py configs/models/bench-tiny-moe.yml [key=value ...]
        [--batches 200] [--steps 40] [--rounds 2] [--out bench.json]

1. loader alone: packed batches per second from the real pipeline (grain over the prepared
   array_record dataset, tokenize on the fly, pack, prefetch thread), as tokens/s;
2. the trainer (`moetext.train.run`, checkpointing off) on the same config with data.kind=tfds
   and with data.kind=synthetic, alternated `--rounds` times; tokens/s is the median of the
   logged intervals after the first quarter of the steps.

The text data defaults to the embedded corpus (data.name=python_docs); pass data.name=... and
data.data_dir=... to measure your own. Prints loader/trainer and tfds/synthetic ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import config as config_lib
from moetext import data as data_lib
from moetext import train


def loader_tokens_per_s(cfg: config_lib.Config, batches: int) -> float:
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    try:
        data.next_batch()  # opens the dataset, starts the prefetch thread
        t0 = time.perf_counter()
        for _ in range(batches):
            data.next_batch()
        dt = time.perf_counter() - t0
    finally:
        data.close()
    return batches * cfg.data.global_batch_size * cfg.data.seq_len / dt


def trainer_tokens_per_s(cfg: config_lib.Config, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        run_cfg = cfg.replace(
            train=dataclasses.replace(
                cfg.train,
                steps=steps,
                run_dir=run_dir,
                log_every=2,
                eval_every=0,
                progress_bar=False,
                peak_tflops=1.0,
            ),
            checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
        )
        train.run(run_cfg)
        rows = [json.loads(x) for x in open(Path(run_dir) / "metrics.jsonl")]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > steps // 4]
    return float(np.median(tps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--batches", type=int, default=200, help="batches timed for the loader")
    p.add_argument("--steps", type=int, default=40, help="trainer steps per run")
    p.add_argument("--rounds", type=int, default=2, help="synthetic/tfds trainer runs each")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()

    text = config_lib.load(
        args.config, ["data.kind=tfds", "data.name=python_docs", *args.overrides]
    )
    synthetic = text.replace(data=dataclasses.replace(text.data, kind="synthetic"))
    loader = loader_tokens_per_s(text, args.batches)
    runs: dict[str, list[float]] = {"synthetic": [], "tfds": []}
    for _ in range(args.rounds):
        for name, cfg in (("synthetic", synthetic), ("tfds", text)):
            runs[name].append(trainer_tokens_per_s(cfg, args.steps))
    trainer_syn, trainer_tfds = (float(np.median(runs[k])) for k in ("synthetic", "tfds"))
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "dataset": text.data.name,
        "loader_tokens_per_s": loader,
        "trainer_tokens_per_s_synthetic": trainer_syn,
        "trainer_tokens_per_s_tfds": trainer_tfds,
        "trainer_runs": runs,
        "loader_over_trainer": loader / trainer_tfds,
        "tfds_over_synthetic": trainer_tfds / trainer_syn,
    }
    for k, v in result.items():
        print(f"{k:>34}: {v:.4g}" if isinstance(v, float) else f"{k:>34}: {v}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
