"""Training throughput of a config: tokens/s and MFU against this machine's dense bf16 peak.

    .venv/bin/python scripts/bench_train.py configs/models/bench-tiny-moe.yml [key=value ...]
        [--steps 20] [--warmup 3] [--out bench.json]

The baseline (dense bf16 matmul FLOP/s) is measured in the same process; MFU is
flops_per_token * tokens/s over that peak (models/flops.py has the FLOP convention).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import moetext  # noqa: F401  (quiets libtpu's TPU probing where there is no TPU)
from moetext import config as config_lib
from moetext import data as data_lib
from moetext.models.flops import flops_per_token
from moetext.train import build
from moetext.train import peak as peak_lib
from moetext.train.loop import jit_train_step, lower_checked, put_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compilation")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()

    cfg = config_lib.load(args.config, [*args.overrides, "checkpoint.enabled=false"])
    b = build(cfg)
    data = data_lib.build(cfg.data, cfg.model.vocab_size)
    # The trainer's own jitted step (plan shardings pinned), traced under the logical rules.
    step = jit_train_step(b)
    batches = [put_batch(data.next_batch(), b.batch_sharding) for _ in range(4)]
    data.close()
    t0 = time.perf_counter()
    step = lower_checked(b, step, b.state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state = b.state
    for i in range(args.warmup):
        state, m = step(state, batches[i % 4])
    jax.block_until_ready(m)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batches[i % 4])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)

    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    dt = float(np.median(times))
    peak = peak_lib.select(None)  # published for TPU/H100/H200, else measured
    fpt = flops_per_token(cfg.model, cfg.moe, cfg.data.seq_len)
    n = jax.device_count()
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "backend": cfg.kernels.gmm_backend,
        "devices": n,
        "platform": jax.default_backend(),
        "tokens_per_step": tokens,
        "compile_s": compile_s,
        "step_time_s_median": dt,
        "step_time_s_min": float(np.min(times)),
        "tokens_per_s": tokens / dt,
        "model_tflops_per_s": fpt * tokens / dt / 1e12,
        "mfu": peak.mfu(fpt * tokens / dt / n),
        "dense_bf16_peak_tflops_per_device": peak.flops / 1e12,
        "peak_source": peak.source,
        "flops_per_token": fpt,
        "final_loss": float(m["loss"]),
    }
    for k, v in result.items():
        print(f"{k:>36}: {v:.4g}" if isinstance(v, float) else f"{k:>36}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
